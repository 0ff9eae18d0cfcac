"""The actors of a command-line run, kept on a cluster that outlives the command for the next command
(``--keep-actors-s``).

A user runs ``ray start --head`` once, then ``python -m rayconv.run ...`` several times: without this
each command pays again for its actors' processes (Ray starting them, torch, torch._dynamo and
torchvision imported, on a GPU the CUDA context). So a command connected to a cluster it did not
start (``--address``, RAY_ADDRESS, or a running local cluster found: ``connect.cluster_outlives_process``)
starts its actors and their placement group detached (Ray's ``lifetime="detached"``: they outlive
the driver), and a run of it that ended normally keeps them there for ``--keep-actors-s`` seconds
(``keep``); the next command that needs the same actors (``pool.actors_key``: class, count, bundle,
runtime environment, and the rayconv code and torch/torchvision/Ray versions the actors run,
``watch.code_hash``) claims them (``claim``) and renews them as ``pool.take`` does in one process;
the run reaches this module through ``cluster.acquire``.

The registry of kept groups is Ray's key-value store (namespace ``rayconv``), one entry per group,
``kept/<hash of the key>/<placement group's name>``: its actors' names (named actors of the ``rayconv``
namespace), its placement group's name, their ``whereami`` info. Claiming is atomic: each actor's
``claim`` succeeds once (under its watchdog's lock), and a command claims rank 0 first, so of two
commands at once one gets the group and the other starts its own. Each actor watches itself
(``cluster.watch``): it ends, its placement group removed, once the driver using it is gone (a killed
command) or once kept ``--keep-actors-s`` seconds unclaimed. A placement group whose command died
before its actors existed (``pending/<name>`` entries, with the creating job) is removed by the next
command that reserves one. Kept actors hold their resources: a command whose placement group cannot
be placed at once (``make_room``), or whose device task finds the cluster's free resources short
(``make_room_for``), stops them (``stop_kept``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from typing import Any, Optional

import ray
from ray.experimental.internal_kv import (_internal_kv_del, _internal_kv_get, _internal_kv_list,
                                          _internal_kv_put)
from ray.util.placement_group import get_placement_group, remove_placement_group

from rayconv.cluster.connect import NAMESPACE, cluster_outlives_process, exception_summary
from rayconv.cluster.pool import KeptActor
from rayconv.cluster.watch import KV_NAMESPACE, code_hash, current_job, job_alive, mark_alive

CLAIM_S = 10.0   # how long a kept actor may take to answer a claim or a keep before it counts as gone
_MODE = {"command": False}
_log = logging.getLogger("rayconv")


def keep_across_commands() -> None:
    """This process is a command (``python -m rayconv.run``): its runs' actors may outlive it, kept on
    the cluster for the next command."""
    _MODE["command"] = True


def enabled() -> bool:
    """Whether this run's actors start detached, to be kept on the cluster for the next command: a
    command on a cluster it did not start, whose job has its life marker (``watch.mark_alive``: by it
    the actors and other commands tell that it runs)."""
    return _MODE["command"] and ray.is_initialized() and cluster_outlives_process() and mark_alive()


def actor_options() -> tuple[dict[str, Any], dict[str, Any]]:
    """(Ray options, constructor keywords) of an actor started now: detached, and watching this
    driver's job (``Actor(watch=...)``), where ``enabled``; else none."""
    return ({"lifetime": "detached"}, {"watch": current_job()}) if enabled() else ({}, {})


def _quiet(default: Any):
    """A registry operation whose failure (Ray's store unreadable) costs only the keeping: logged, and
    ``default`` returned instead of a traceback from inside Ray."""
    def wrap(fn):
        @functools.wraps(fn)
        def quiet(*args, **kw):
            try:
                return fn(*args, **kw)
            except Exception as e:  # noqa: BLE001 - see the docstring
                _log.info("rayconv: %s failed (%s)", fn.__name__, exception_summary(e))
                return default
        return quiet
    return wrap


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _get(entry: bytes) -> Optional[dict[str, Any]]:
    try:
        return json.loads(_internal_kv_get(entry, namespace=KV_NAMESPACE) or b"null")
    except (ValueError, TypeError):
        return None


def _del(entry: Any) -> None:
    try:
        _internal_kv_del(entry, namespace=KV_NAMESPACE)
    except Exception:  # noqa: BLE001 - gone already
        pass


def _answers(refs: list[Any]) -> Optional[list[Any]]:
    """The results of ``refs`` within CLAIM_S seconds; None when any fails or is late (a gone actor)."""
    try:
        return ray.get(refs, timeout=CLAIM_S)
    except Exception:  # noqa: BLE001 - gone, dying or stuck: not usable
        return None


def _remove_pg(name: str) -> None:
    try:
        remove_placement_group(get_placement_group(name))
    except Exception:  # noqa: BLE001 - removed already
        pass


@_quiet(None)
def pending(pg_name: str) -> None:
    """Note that this command's placement group ``pg_name`` exists before its actors do (their
    watchdogs guard it from then on: ``created`` drops the note); nothing where not ``enabled``."""
    if enabled():
        _internal_kv_put(f"pending/{pg_name}", json.dumps({"job": current_job(), "pg": pg_name}),
                         namespace=KV_NAMESPACE)


@_quiet(None)
def created(pg_name: str) -> None:
    """The actors of the ``pending`` placement group ``pg_name`` exist (or it was removed): the note
    is dropped."""
    if enabled():
        _del(f"pending/{pg_name}")


@_quiet(None)
def sweep() -> None:
    """Remove the placement groups of commands that died before their actors existed (``pending``)."""
    if not enabled():
        return
    for entry in _internal_kv_list("pending/", namespace=KV_NAMESPACE):
        note = _get(entry)
        if note is not None and not job_alive(note.get("job", "")):
            _remove_pg(note.get("pg", ""))
            _del(entry)


def keep(group: Any, keep_s: float) -> bool:
    """Keep ``group`` (an ActorGroup of a run that ended normally, detached: ``enabled``) on the
    cluster for ``keep_s`` seconds, for the next command; True when kept (``group`` is then empty: its
    ``kill`` does nothing). False (the caller stops it) when ``keep_s`` is 0, it does not own its
    placement group, an actor does not answer, or an actor runs other code than this driver."""
    if keep_s <= 0 or not group.owns_pg or group.starting is not None or not group.actors or not group.names:
        return False
    try:
        pg_name = ray.util.placement_group_table(group.pg)["name"]
        entry = f"kept/{_hash(group.key)}/{pg_name}"
        codes = _answers(group.submit(KeptActor.keep, group.key, keep_s, entry).refs)
        if codes is None or any(c != code_hash() for c in codes):
            return False
        _internal_kv_put(entry, json.dumps({"key": group.key, "actors": group.names, "pg": pg_name,
                                            "info": group.info, "kept_at": time.time(),
                                            "keep_s": keep_s}), namespace=KV_NAMESPACE)
    except Exception as e:  # noqa: BLE001 - not kept: the caller stops them
        _log.info("rayconv: actors not kept on the cluster (%s)", exception_summary(e))
        return False
    group.hand_over()
    return True


def claim(key: str, world_size: int) -> Optional[tuple[list[Any], list[str], Any, list[dict[str, Any]]]]:
    """(actors in rank order, their names, placement group, their ``whereami`` info) of a group a
    previous command kept on the cluster for ``key``, now this driver's (in use by its job); None when
    no kept group matches (or none answers). Registry entries of groups that are gone are dropped."""
    if not enabled():
        return None
    job = current_job()
    for entry in _internal_kv_list(f"kept/{_hash(key)}/", namespace=KV_NAMESPACE):
        kept = _get(entry)
        if kept is None or kept.get("key") != key or len(kept.get("actors", ())) != world_size:
            continue
        try:
            actors = [ray.get_actor(name, namespace=NAMESPACE) for name in kept["actors"]]
            pg = get_placement_group(kept["pg"])
        except ValueError:   # (an actor or the placement group is gone: the rest end themselves)
            _del(entry)
            continue
        if _answers([actors[0].claim.remote(key, job)]) != [True]:
            continue   # (another command's now, or ending)
        _del(entry)
        if _answers([a.claim.remote(key, job) for a in actors[1:]]) != [True] * (world_size - 1):
            _kill(actors, pg)
            continue
        return actors, list(kept["actors"]), pg, list(kept.get("info") or [])
    return None


KEPT_WAIT_S = 1.0   # how long a request for resources waits before the actors kept on the cluster are stopped


def make_room(ref: Any, timeout_s: float) -> None:
    """Wait up to ``KEPT_WAIT_S`` (at most ``timeout_s``) for ``ref`` (a placement group's ``ready()``, a
    task's result); if it is not there by then, the groups kept on the cluster for another command
    (which hold GPUs and CPUs) are stopped, so that the request can be placed."""
    if not ray.wait([ref], timeout=min(timeout_s, KEPT_WAIT_S))[0] and stop_kept():
        _log.info("rayconv: stopped the actors kept on the cluster for lack of resources")


def make_room_for(need: dict[str, float]) -> None:
    """Stop the groups kept on the cluster for another command when the cluster's free resources
    (``ray.available_resources``) do not hold ``need`` (e.g. {"GPU": 1, "CPU": 1}: a task's)."""
    if not (ray.is_initialized() and cluster_outlives_process()):
        return
    from rayconv.cluster.pool import fits

    if not fits(ray.available_resources(), need) and stop_kept():
        _log.info("rayconv: stopped the actors kept on the cluster for lack of resources")


@_quiet(0)
def stop_kept() -> int:
    """Stop every group kept on the cluster (claimed first, so that none in use is stopped): their
    resources are free again. Returns how many were stopped."""
    if not (ray.is_initialized() and cluster_outlives_process()):
        return 0
    stopped = 0
    job = current_job()
    for entry in _internal_kv_list("kept/", namespace=KV_NAMESPACE):
        kept = _get(entry) or {}
        try:
            actors = [ray.get_actor(name, namespace=NAMESPACE) for name in kept.get("actors", ())]
        except ValueError:
            actors = []
        if actors and _answers([actors[0].claim.remote(kept.get("key"), job)]) != [True]:
            continue
        _del(entry)
        _kill(actors, None)
        _remove_pg(kept.get("pg", ""))
        stopped += 1
    return stopped


def _kill(actors: list[Any], pg: Any) -> None:
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - gone already
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - removed already
            pass

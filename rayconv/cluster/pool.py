"""The actors of a finished run, kept for the next run of the same Python process (``--keep-actors-s``).

An actor's process costs seconds to start: Ray starts it, it imports torch and torch._dynamo (and on a
GPU makes its CUDA context). A second ``rayconv.fit`` in the same process (a notebook, a script's loop
over settings, the test suite) that needs the same actors takes the kept ones instead: the same
placement group, the same processes, each renewed (``ActorGroup.renew``: its previous run's state
dropped, its process groups left, torch.compile's caches reset) before the new run's ``build``. This is
Ray Tune's ``reuse_actors`` (``TuneConfig``) for rayconv's gangs of actors.

"The same actors": the same actor class, count, bundle (CPUs, GPU share), runtime environment (a
user's modules by the content hash of their upload, a pickled model) and cluster connection; for the
actors of a Ray Tune trial, also the trial's placement group (``rayconv.tune`` reuses the trial's
process and placement group for the next trial: ``TuneConfig(reuse_actors=True)``, ``Trial.reset_config``).
Several groups are kept side by side (a loop over layouts of 1, 2 and 4 actors, trials of several
sizes), each for ``--keep-actors-s`` seconds from its run's end (a timer thread): a run that needs other
actors leaves them kept while its placement group fits beside them; where it does not, it takes the
first actors of the smallest larger kept group of its kind on one node (``take`` with the run's
``need``: the others rest in that group's placement group until it is kept again), and otherwise
stops kept groups, the longest unused first, until the cluster's free resources hold it
(``make_room``; all of them where the group still waits a moment later, as a PACK group that must fit
one node may). Whatever else of rayconv asks the cluster for resources (a task that measures a device,
``rayconv.prepare``'s tasks) and ``rayconv.release_actors()`` stop them all. A run that ended normally
keeps its actors, and so does a run its checks refused after its actors started early (unused,
perhaps still starting); a failed, stopped or interrupted run's are killed. A command-line run on a
cluster that outlives it (``ray start --head``, then commands with ``--address`` or none) keeps its
actors on the cluster instead, for the next command (``cluster.across``: a run that ended normally
only); on a cluster it started itself they end with its process. The run reaches this module only
through ``cluster.acquire`` (``acquire``, ``release``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import ray

from rayconv.cluster.watch import code_hash


class KeptActor(Protocol):
    """The methods the cluster layer calls on the actor class it is handed (``actor.actor.Actor``, from
    ``actor.lifecycle``): the typed references ``ActorGroup.submit`` takes for its own calls."""

    def whereami(self) -> dict[str, Any]: ...

    def renew(self, cfg: dict[str, Any], run_name: str, role: str) -> None: ...

    def keep(self, key: str, keep_s: float, entry: str) -> Optional[str]: ...


@dataclass(eq=False)   # (told apart by identity)
class _Kept:
    group: Any      # the ActorGroup
    key: str
    cluster: str    # the GCS address the actors live on
    timer: Optional[threading.Timer]


_LOCK = threading.Lock()
_KEPT: list[_Kept] = []   # the kept groups, the longest unused first


def actors_key(actor_cls: type, world_size: int, bundle: dict[str, float], env: Optional[dict[str, Any]],
               given_pg: Optional[str] = None) -> str:
    """What kept actors must match to serve a run: class, count, bundle, runtime environment (after
    the upload, so a changed module is another environment) and the code they run (rayconv's files,
    torch's, torchvision's and Ray's versions: ``watch.code_hash``; actors kept on the cluster may
    have been started by another command, from another checkout); and ``given_pg``, the id of the
    placement group they were started in when it is not the run's own (a Tune trial's: the next trial
    that Tune runs in the same process and placement group takes them)."""
    return json.dumps([f"{actor_cls.__module__}.{actor_cls.__qualname__}", world_size,
                       sorted(bundle.items()), env, code_hash(), given_pg], sort_keys=True, default=str)


def _cluster() -> Optional[str]:
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def keep(group: Any, key: str, keep_s: float) -> bool:
    """Keep ``group`` (an ActorGroup of a run that ended normally, or the actors a refused run started
    early, perhaps still starting) for ``keep_s`` seconds, beside any kept before. A group in a
    placement group it does not own (a Tune trial's) keeps it: stopping the group leaves that
    placement group to its owner. False (nothing kept) when ``keep_s`` is 0 or the group is empty."""
    if keep_s <= 0 or not group.actors:
        return False
    kept = _Kept(group.hand_over(), key, _cluster() or "", None)
    kept.timer = threading.Timer(keep_s, _expire, args=(kept,))
    kept.timer.daemon = True
    with _LOCK:
        _KEPT.append(kept)
    kept.timer.start()
    return True


def take(key: str, cfg_dict: dict[str, Any], run_name: str, roles: list[str],
         need: Optional[dict[str, float]] = None) -> Optional[Any]:
    """The kept group that matches ``key`` on this cluster (the last kept of several), its actors renewed
    for the run ``run_name`` (``ActorGroup.renew``: ``Actor.renew(cfg_dict, run_name, role)``, in rank
    order) and its roles set; else None. The other kept groups stay kept; those of another cluster
    connection are dropped. A kept actor that does not renew (gone, failed) makes it None too, its group
    stopped: the run starts its own.

    ``need`` (the run's placement group in all), given: where no group matches and the cluster's free
    resources do not hold ``need``, the smallest kept group of more such actors (``key`` but for the
    count), all on one node and in a placement group of its own, with its first ``len(roles)`` actors
    renewed for the run and the others resting in it as ``spare`` (``ActorGroup.rest_after``) until it is
    kept again; else None. Such a run holds the larger group's resources while it runs, instead of those
    being freed for new actors of its size (which would cost each a process start)."""
    same = _take_same(key, cfg_dict, run_name, roles)
    if same is not None or need is None:
        return same
    return _take_larger(key, need, cfg_dict, run_name, roles)


def _take_same(key: str, cfg_dict: dict[str, Any], run_name: str, roles: list[str]) -> Optional[Any]:
    """``take`` of a kept group that matches ``key`` (its docstring)."""
    here = _cluster()
    with _LOCK:
        gone = [k for k in _KEPT if k.cluster != here]
        match = next((k for k in reversed(_KEPT) if k.cluster == here and k.key == key
                      and len(k.group.actors) == len(roles)), None)
        _KEPT[:] = [k for k in _KEPT if k not in gone and k is not match]
    for k in gone:
        _stop(k)   # (their timers: the actors live on the other cluster, left to it)
    if match is None:
        return None
    return _renewed(match, cfg_dict, run_name, roles)


def _renewed(kept: _Kept, cfg_dict: dict[str, Any], run_name: str, roles: list[str]) -> Optional[Any]:
    """``kept``'s group, taken out of the pool (its timer stopped) and renewed for the run ``run_name``
    (``ActorGroup.renew``); None when it does not renew, its group then stopped."""
    if kept.timer is not None:
        kept.timer.cancel()
    if not kept.group.renew(cfg_dict, run_name, roles):
        _stop(kept)
        return None
    return kept.group


def _take_larger(key: str, need: dict[str, float], cfg_dict: dict[str, Any], run_name: str,
                 roles: list[str]) -> Optional[Any]:
    """``take`` of the first actors of a larger kept group (its docstring)."""
    if fits(ray.available_resources(), need):
        return None   # (new actors fit beside the kept ones)
    here, kind = _cluster(), _kind(key)
    with _LOCK:
        match = min((k for k in _KEPT if k.cluster == here and _kind(k.key) == kind and k.group.owns_pg
                     and len(k.group.actors) > len(roles)), key=lambda k: len(k.group.actors), default=None)
        if match is None:
            return None
        place = _KEPT.index(match)
        _KEPT.remove(match)
    try:
        match.group.wait_started()   # (a refused run's actors, started early: where they run)
    except Exception:  # noqa: BLE001 - they did not start (``collect`` killed them): the run starts its own
        _stop(match)
        return None
    if len({i.get("node_id") for i in match.group.info}) != 1:   # (ranks over nodes: not cut)
        with _LOCK:
            _KEPT.insert(min(place, len(_KEPT)), match)
        return None
    match.group.rest_after(len(roles))
    return _renewed(match, cfg_dict, run_name, roles)


def _kind(key: str) -> str:
    """``key`` (``actors_key``) without its count of actors."""
    parts = json.loads(key)
    return json.dumps(parts[:1] + parts[2:])


def make_room(need: dict[str, float]) -> None:
    """Stop kept groups, the longest unused first, until the cluster's free resources
    (``ray.available_resources``, plus what the stopped groups' placement groups held) hold ``need``
    (e.g. {"CPU": 4}: a run's placement group in all)."""
    if not ray.is_initialized():
        return
    with _LOCK:
        kept = list(_KEPT)
    if not kept:
        return
    free = dict(ray.available_resources())
    for k in kept:
        if fits(free, need):
            return
        with _LOCK:
            if k not in _KEPT:
                continue
            _KEPT.remove(k)
        _stop(k)
        _add(free, _held(k.group))


def fits(free: dict[str, float], need: dict[str, float]) -> bool:
    """Whether the resources ``free`` (e.g. ``ray.available_resources()``) hold ``need`` (e.g. {"CPU": 4})."""
    return all(free.get(r, 0.0) + 1e-9 >= v for r, v in need.items() if v)


def _held(group: Any) -> dict[str, float]:
    """The resources a kept ``group``'s own placement group holds (none for a group in a placement group
    it does not own: a Tune trial's, left to its owner)."""
    held: dict[str, float] = {}
    if group.owns_pg and group.pg is not None:
        for bundle in group.pg.bundle_specs:
            _add(held, bundle)
    return held


def _add(total: dict[str, float], more: dict[str, float]) -> None:
    for r, v in more.items():
        total[r] = total.get(r, 0.0) + v


def release() -> None:
    """Stop every kept group and remove their placement groups (safe to repeat): the cluster's
    resources are free again."""
    with _LOCK:
        kept, _KEPT[:] = list(_KEPT), []
    for k in kept:
        _stop(k)


def kept_group() -> Optional[Any]:
    """The ActorGroup kept last, or None."""
    with _LOCK:
        return _KEPT[-1].group if _KEPT else None


def kept_groups() -> list[Any]:
    """The ActorGroups kept now, the longest unused first."""
    with _LOCK:
        return [k.group for k in _KEPT]


def kept_resources() -> dict[str, float]:
    """The resources the placement groups of the groups kept now hold, in all (e.g. {"CPU": 3.0})."""
    total: dict[str, float] = {}
    for g in kept_groups():
        _add(total, _held(g))
    return total


def _expire(kept: _Kept) -> None:
    with _LOCK:
        if kept not in _KEPT:
            return
        _KEPT.remove(kept)
    _stop(kept)


def _stop(kept: _Kept) -> None:
    """End ``kept``'s wait (its timer) and stop its actors where they live on this process's cluster."""
    if kept.timer is not None:
        kept.timer.cancel()
    if kept.cluster and kept.cluster == _cluster():
        kept.group.kill()

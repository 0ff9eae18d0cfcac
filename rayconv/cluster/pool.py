"""The actors of a finished run, kept for the next run of the same Python process (``--keep-actors-s``).

An actor's process costs seconds to start: Ray starts it, it imports torch and torch._dynamo (and on a
GPU makes its CUDA context). A second ``rayconv.fit`` in the same process (a notebook, a script's loop
over settings, the test suite) that needs the same actors takes the kept ones instead: the same
placement group, the same processes, each ``renew``-ed (its previous run's state dropped, its process
groups left, torch.compile's caches reset) before the new run's ``build``. This is Ray Tune's
``reuse_actors`` (``TuneConfig``) for rayconv's gangs of actors.

"The same actors": the same actor class, count, bundle (CPUs, GPU share), runtime environment (a
user's modules by the content hash of their upload, a pickled model) and cluster connection; for the
actors of a Ray Tune trial, also the trial's placement group (``rayconv.tune`` reuses the trial's
process and placement group for the next trial: ``TuneConfig(reuse_actors=True)``, ``Trial.reset_config``). One group
is kept at a time; a run that needs other actors stops it first (its resources are the cluster's again),
as does whatever else of rayconv asks the cluster for resources (a placement group, a task that measures
a device, ``rayconv.prepare``'s tasks), ``rayconv.release_actors()``, and ``--keep-actors-s`` seconds
of waiting (a timer thread). A run that ended normally leaves its actors, and so does a run its checks
refused after its actors started early (``driver.early``: unused, perhaps still starting); a failed,
stopped or interrupted run's are killed. A command-line run on a cluster that outlives it (``ray start
--head``, then commands with ``--address`` or none) leaves its actors on the cluster instead, for the next
command (``cluster.across``: a run that ended normally only); on a cluster it started itself they end
with its process.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray

from rayconv.cluster.connect import exception_summary
from rayconv.cluster.watch import code_hash

RENEW_S = 30.0  # how long kept actors may take to renew before new ones are started instead


@dataclass
class _Kept:
    group: Any      # the ActorGroup
    key: str
    cluster: str    # the GCS address the actors live on
    timer: Optional[threading.Timer]


_LOCK = threading.Lock()
_KEPT: dict[str, Optional[_Kept]] = {"now": None}


def actors_key(actor_cls: type, world_size: int, bundle: dict[str, float], env: Optional[dict[str, Any]],
               given_pg: Optional[str] = None) -> str:
    """What kept actors must match to serve a run: class, count, bundle, runtime environment (after
    the upload, so a changed module is another environment) and the code they run (rayconv's files,
    torch's, torchvision's and Ray's versions: ``watch.code_hash``; actors kept on the cluster may
    have been started by another command, from another checkout); and ``given_pg``, the id of the
    placement group they were started in when it is not the run's own (a Tune trial's: the next trial
    that Tune runs in the same process and placement group takes them)."""
    return json.dumps([f"{actor_cls.__module__}.{actor_cls.__qualname__}", world_size, sorted(bundle.items()), env,
                       code_hash(), given_pg], sort_keys=True, default=str)


def _cluster() -> Optional[str]:
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def keep(group: Any, key: str, keep_s: float) -> bool:
    """Keep ``group`` (an ActorGroup of a run that ended normally, or the actors a refused run started
    early, perhaps still starting) for ``keep_s`` seconds; any group kept before is stopped. A group in
    a placement group it does not own (a Tune trial's) keeps it: stopping the group leaves that
    placement group to its owner. False (nothing kept) when ``keep_s`` is 0 or the group is empty."""
    if keep_s <= 0 or not group.actors:
        return False
    release()
    kept = group.hand_over()
    timer = threading.Timer(keep_s, _expire, args=(kept,))
    timer.daemon = True
    with _LOCK:
        _KEPT["now"] = _Kept(kept, key, _cluster() or "", timer)
    timer.start()
    return True


def take(key: str, cfg_dict: dict[str, Any], run_name: str, roles: list[str]) -> Optional[Any]:
    """The kept group when it matches ``key`` on this cluster, its actors renewed for the run
    ``run_name`` (``Actor.renew(cfg_dict, run_name, role)``, in rank order) and its roles set; else None,
    with any kept group stopped (its resources free for the run's own). A kept actor that does not
    renew (gone, failed) makes it None too: the run starts its own."""
    with _LOCK:
        kept, _KEPT["now"] = _KEPT["now"], None
    if kept is None:
        return None
    if kept.timer is not None:
        kept.timer.cancel()
    if kept.key != key or kept.cluster != _cluster() or len(kept.group.actors) != len(roles):
        _stop(kept)
        return None
    if not renew(kept.group, cfg_dict, run_name, roles):
        _stop(kept)
        return None
    return kept.group


def renew(group: Any, cfg_dict: dict[str, Any], run_name: str, roles: list[str]) -> bool:
    """Renew the actors of a kept ``group`` for the run ``run_name`` (``Actor.renew(cfg_dict, run_name,
    role)``, in rank order, within RENEW_S seconds, plus what is left of the start-up limit of actors
    still starting) and set its roles; False when one does not (gone, failed: the group is then
    stopped, ``collect`` kills it, and the run starts its own)."""
    left_s = 0.0 if group.starting is None else max(0.0, group.starting[1] - time.monotonic())
    try:
        group.collect(group.submit_each("renew", [(cfg_dict, run_name, r) for r in roles]), timeout_s=RENEW_S + left_s)
    except Exception as e:  # noqa: BLE001 - the group is stopped (collect kills it); the run starts its own
        import logging

        logging.getLogger("rayconv").info("kept actors did not renew (%s): starting new ones", exception_summary(e))
        group.kill()
        return False
    group.roles, group.reused = list(roles), True
    return True


def release() -> None:
    """Stop the kept actors, if any, and remove their placement group (safe to repeat): the
    cluster's resources are free again."""
    with _LOCK:
        kept, _KEPT["now"] = _KEPT["now"], None
    if kept is not None:
        if kept.timer is not None:
            kept.timer.cancel()
        _stop(kept)


def kept_group() -> Optional[Any]:
    """The ActorGroup kept now, or None."""
    kept = _KEPT["now"]
    return None if kept is None else kept.group


def _expire(kept: _Kept) -> None:
    with _LOCK:
        if _KEPT["now"] is not kept:
            return
        _KEPT["now"] = None
    _stop(kept)


def _stop(kept: _Kept) -> None:
    if kept.cluster and kept.cluster == _cluster():
        kept.group.kill()

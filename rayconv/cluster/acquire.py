"""Every way a run gets its actors, behind one seam: ``acquire(spec) -> actors``, ``release(actors, keep=s)``.

    acquire(spec)    the actors started early for this run (``acquire(spec, early=True)`` while the
                     driver still checks), else those a previous run of this process kept (``pool``:
                     the same kind, else the first actors of a larger kept group), else those a previous
                     command kept on the cluster (``across``: claimed), else new ones (``group``: a
                     placement group reserved, the actors started); alive, renewed for the run
    release(actors, keep=s)   kept s seconds for the next run (on the cluster where they may outlive
                     this process, else in this process), or stopped
    release_started(run_name, keep=s)   the actors started early for a run that did not take them
                     (refused by its checks: kept in this process; any other end: stopped)
    release_kept()   every group kept in this process stopped (``rayconv.release_actors``)
    keep_across_commands()   this process is a command: its actors may be kept on the cluster

``ActorSpec`` is what the layout needs of its actors: their count and roles (the mesh), each one's
resources (``actor_bundle``), where they go (one placement group, PACK; a Tune trial's given one:
``given_group``), and the code they run (the actor class, the runtime environment: ``actors_env``, the
code hash: ``pool.actors_key``). This module works them out: ``group`` is handed plain values.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from ray.util.placement_group import get_current_placement_group

from rayconv.cluster import across, pool
from rayconv.cluster.connect import ALL_GPUS_VISIBLE_ENV, exception_summary, with_uploads
from rayconv.cluster.group import ActorGroup, create_actors, reserve
from rayconv.config import Config
from rayconv.errors import ClusterError, ConfigError, DataError
from rayconv.mesh import Mesh
from rayconv.user_model import actor_runtime_env

RESERVE_S = 2.0  # how long an early start waits for free bundles before leaving the start for later
_STARTED: dict[str, tuple[Mesh, ActorGroup]] = {}   # actors started early, by run name, not yet acquired


def actor_bundle(cfg: Config) -> dict[str, float]:
    """What one actor of ``cfg`` (device resolved) reserves: on GPUs 1 CPU and ``--gpus-per-actor`` of a
    GPU, on CPU ``--num-cpus-per-actor`` CPUs."""
    return {"CPU": 1, "GPU": cfg.gpus_per_actor} if cfg.device == "cuda" else {"CPU": cfg.num_cpus_per_actor}


def actors_env(cfg: Config, mesh: Mesh) -> Optional[dict[str, Any]]:
    """The actors' runtime environment: a user's modules (uploaded: ``with_uploads``) and the GPU
    visibility setting (``--all-gpus-visible``) where there are NCCL peers: a mesh of one actor sees its
    GPU alone, which is the same to it, and without an environment of its own it starts in one of the
    worker processes Ray starts for the job when it connects, not in a new one (seconds sooner). None
    when there is nothing."""
    sees_all = cfg.device == "cuda" and cfg.all_gpus_visible and mesh.world_size > 1
    return with_uploads(actor_runtime_env(cfg.model, ALL_GPUS_VISIBLE_ENV if sees_all else {}))


@dataclass(frozen=True)
class ActorSpec:
    """What a run needs of its actors: ``actor_cls`` (``rayconv.actor.actor.Actor``) started with the
    settings ``cfg`` (device resolved: each actor's bundle, the model's runtime environment) in the roles
    of ``mesh``, named ``rayconv/<run_name>/<role>``; ``timeout_s``: the start-up limit (None: --max-wait)."""

    actor_cls: type
    cfg: Config
    mesh: Mesh
    run_name: str
    timeout_s: Optional[float] = None

    @property
    def limit_s(self) -> float:
        return self.cfg.max_wait if self.timeout_s is None else self.timeout_s

    @property
    def roles(self) -> list[str]:
        return [self.mesh.role(r) for r in range(self.mesh.world_size)]

    @property
    def bundle(self) -> dict[str, float]:
        """What each actor reserves (``actor_bundle``)."""
        return actor_bundle(self.cfg)

    @property
    def need(self) -> dict[str, float]:
        """What the run's placement group reserves in all: ``bundle`` once per actor."""
        return {r: v * self.mesh.world_size for r, v in self.bundle.items()}

    @functools.cached_property
    def env(self) -> Optional[dict[str, Any]]:
        """The actors' runtime environment (``actors_env``: a user's modules uploaded once)."""
        return actors_env(self.cfg, self.mesh)

    def key(self, given_pg: Optional[str] = None) -> str:
        """What kept actors must match to serve this spec (``pool.actors_key``); ``given_pg``: the id of
        the placement group the run was given (``given_group``)."""
        return pool.actors_key(self.actor_cls, self.mesh.world_size, self.bundle, self.env, given_pg)


def given_group(spec: ActorSpec) -> Optional[tuple[Any, int]]:
    """(placement group, index of the first of its last ``mesh.world_size`` bundles) when this process
    runs inside a placement group (``get_current_placement_group``: a Ray Tune trial's), else None. Raises
    ClusterError when that group's last bundles cannot each hold one actor of ``spec``."""
    pg = get_current_placement_group()
    if pg is None:
        return None
    bundles = [dict(b) for b in pg.bundle_specs]
    mesh, need = spec.mesh, spec.bundle
    first = len(bundles) - mesh.world_size
    mine = bundles[max(0, first):]
    if first < 0 or any(b.get(k, 0) + 1e-9 < v for b in mine for k, v in need.items()):
        raise ClusterError(f"this run is inside a placement group of bundles {bundles}, which does not end "
                           f"in {mesh.world_size} x {need} (layout {mesh.describe()}): give the group one "
                           "such bundle per actor (rayconv.tune does), or start the run outside it")
    return pg, first


def acquire(spec: ActorSpec, *, early: bool = False) -> Optional[ActorGroup]:
    """The run's actors (the module docstring's order), alive within ``spec.limit_s``. Raises
    ClusterError; the actors are stopped on any failure.

    ``early``: start them without waiting, while the driver still checks (the reservation waits at most
    ``RESERVE_S``); the run's next ``acquire`` takes them where its mesh is the same (else they are
    stopped). Returns the actors started early for ``spec.run_name`` (again, where started already),
    or None where they cannot start at once: the run acquires after its checks, where the error is met
    again and reported."""
    if early:
        return _start_early(spec)
    started = _STARTED.pop(spec.run_name, None)
    group = None
    if started is not None and started[0] == spec.mesh:
        group = started[1]
    elif started is not None:
        started[1].kill()
    if group is None:
        group = _start(spec)
    try:
        group.wait_started()
    except BaseException:
        group.kill()
        raise
    return group


def release(actors: ActorGroup, *, keep: float = 0.0) -> Optional[str]:
    """Keep the actors of a run that ended normally for ``keep`` seconds: on the cluster for the next
    command where they may outlive this process (``across.keep``: "cluster"), else for the next run of
    this process (``pool.keep``: "process"); else (``keep`` 0, or not kept) stop them and their placement
    group (None)."""
    if across.enabled():
        if across.keep(actors, keep):
            return "cluster"
    elif pool.keep(actors, actors.key, keep):
        return "process"
    actors.kill()
    return None


def release_started(run_name: Optional[str], *, keep: float = 0.0) -> None:
    """The actors started early for ``run_name`` and not acquired (safe to repeat): kept for the next
    run of this process for ``keep`` seconds (a run its checks refused: the corrected run takes them),
    not where they may outlive this process (a command ends at its error); else stopped."""
    started = _STARTED.pop(run_name, None) if run_name is not None else None
    if started is None:
        return
    group = started[1]
    if keep > 0 and not across.enabled() and pool.keep(group, group.key, keep):
        return
    group.kill()


def release_kept() -> None:
    """Stop every group kept in this process and remove their placement groups (safe to repeat)."""
    pool.release()


def keep_across_commands() -> None:
    """This process is a command (``python -m rayconv.run``): on a cluster it did not start, its runs'
    actors start detached and ``release`` keeps them on the cluster for the next command (``across``)."""
    across.keep_across_commands()


def _start_early(spec: ActorSpec) -> Optional[ActorGroup]:
    if spec.run_name in _STARTED:
        return _STARTED[spec.run_name][1]
    try:
        group = _start(spec, wait=False)
    except (ClusterError, ConfigError, DataError):
        return None   # (nothing stays reserved: reserve and create_actors remove what they made)
    _STARTED[spec.run_name] = (spec.mesh, group)
    return group


def _start(spec: ActorSpec, *, wait: bool = True) -> ActorGroup:
    """Kept actors, else new ones: one bundle per actor reserved, the actors started in rank order
    (``group.create_actors``). ``spec.limit_s`` bounds the whole start-up: reserving the bundles (waiting
    for free resources) and the actors' processes starting and importing torch. ``wait`` False (the early
    start): the reservation waits at most ``RESERVE_S`` and the actors are not waited for. Raises
    ClusterError saying which of the two ran out and that --max-wait raises it, or naming a Ray error at
    start."""
    t0 = time.monotonic()
    given = given_group(spec)
    if given is not None:   # a Tune trial's group: its bundles are this run's
        return _in_given_group(spec, given, spec.limit_s, wait=wait)
    kept = _kept(spec)
    if kept is not None:
        return kept
    pg = reserve(spec.bundle, spec.mesh.world_size, spec.run_name,
                 spec.limit_s if wait else min(spec.limit_s, RESERVE_S))
    return create_actors(spec.actor_cls, spec.cfg.to_dict(), spec.roles, spec.run_name, pg,
                         max(0.0, spec.limit_s - (time.monotonic() - t0)), bundle=spec.bundle, env=spec.env,
                         key=spec.key(), limit_s=spec.limit_s, wait=wait)


def _in_given_group(spec: ActorSpec, given: tuple[Any, int], timeout_s: float, wait: bool) -> ActorGroup:
    """The actors of a run inside a placement group it was given (``given_group``: a Tune trial's):
    those the trial's process kept from its last run there (Tune handed the process and its placement
    group to this trial), renewed, or new ones in its bundles (``group.create_actors``)."""
    pg, first = given
    key = spec.key(pg.id.hex())
    kept = pool.take(key, spec.cfg.to_dict(), spec.run_name, spec.roles)
    if kept is not None:
        return kept
    pool.release()   # (groups kept in this placement group hold the bundles the new actors need)
    return create_actors(spec.actor_cls, spec.cfg.to_dict(), spec.roles, spec.run_name, pg, timeout_s,
                         bundle=spec.bundle, env=spec.env, key=key, first_bundle=first, wait=wait)


def _kept(spec: ActorSpec) -> Optional[ActorGroup]:
    """The actors a previous run of this process kept (``pool.take``: the same kind; where the run does
    not fit beside the kept groups, the first actors of a larger one), or a previous command kept on
    the cluster (``across.claim``), renewed for this run; else None."""
    key, roles, settings = spec.key(), spec.roles, spec.cfg.to_dict()
    group = pool.take(key, settings, spec.run_name, roles)
    if group is not None:
        return group
    try:
        claimed = across.claim(key, spec.mesh.world_size)
    except Exception as e:  # noqa: BLE001 - the registry unreadable: the run starts its own
        logging.getLogger("rayconv").info("rayconv: no kept actors looked up on the cluster (%s)",
                                          exception_summary(e))
        return None
    if claimed is None:
        return pool.take(key, settings, spec.run_name, roles, need=spec.need)
    actors, names, pg, info = claimed
    group = ActorGroup(actors, roles, pg, info, key=key, names=names, across=True)
    return group if group.renew(settings, spec.run_name, roles) else None

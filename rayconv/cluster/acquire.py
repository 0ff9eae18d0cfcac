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
code hash: ``pool.actors_key``). This module works them out and asks ``pool``, ``across`` and ``group``
in that order, each in one place (``_start``), with plain values.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from ray.util.placement_group import get_current_placement_group

from rayconv.cluster import across, pool
from rayconv.cluster.connect import ALL_GPUS_VISIBLE_ENV, exception_summary
from rayconv.cluster.group import ActorGroup, create_actors, reserve
from rayconv.cluster.ship import with_modules
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
    """The actors' runtime environment: a user's modules (shipped: ``ship.with_modules``) and the GPU
    visibility setting (``--all-gpus-visible``) where there are NCCL peers: a mesh of one actor sees its
    GPU alone, which is the same to it, and without an environment of its own it starts in one of the
    worker processes Ray starts for the job when it connects, not in a new one (seconds sooner). None
    when there is nothing."""
    sees_all = cfg.device == "cuda" and cfg.all_gpus_visible and mesh.world_size > 1
    return with_modules(actor_runtime_env(cfg.model, ALL_GPUS_VISIBLE_ENV if sees_all else {}))


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
        """The actors' runtime environment (``actors_env``: a user's modules shipped once)."""
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
    if early and spec.run_name in _STARTED:
        return _STARTED[spec.run_name][1]
    group = _taken_early(spec)   # (none for an early start)
    if group is None:
        try:
            group = _start(spec, wait=not early)
        except (ClusterError, ConfigError, DataError):
            if not early:
                raise
            return None   # (nothing stays reserved: reserve and create_actors remove what they made)
    if early:
        _STARTED[spec.run_name] = (spec.mesh, group)
        return group
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


def _taken_early(spec: ActorSpec) -> Optional[ActorGroup]:
    """The actors started early for ``spec.run_name``, taken where they have its mesh (else stopped)."""
    started = _STARTED.pop(spec.run_name, None)
    if started is None:
        return None
    mesh, group = started
    if mesh == spec.mesh:
        return group
    group.kill()
    return None


def _start(spec: ActorSpec, *, wait: bool = True) -> ActorGroup:
    """Kept actors, else new ones (the module docstring's order 2 to 4), each place asked once: the
    pool (the same kind, else, where the run does not fit beside the kept groups, the first actors of a
    larger one; else kept groups stopped until it fits), the cluster's registry (``across``), then the
    group (a claimed group renewed; else one bundle per actor reserved and the actors started in rank
    order). Inside a placement group the run was given (``given_group``: a Tune trial's), only the
    actors the trial's process kept from its last run there (Tune handed the process and its placement
    group to this trial), else new ones in its last bundles. ``spec.limit_s`` bounds the whole start-up:
    reserving the bundles (waiting for free resources) and the actors' processes starting and importing
    torch. ``wait`` False (the early start): the reservation waits at most ``RESERVE_S`` and the actors
    are not waited for. Raises ClusterError saying which of the two ran out and that --max-wait raises
    it, or naming a Ray error at start."""
    t0, limit_s = time.monotonic(), spec.limit_s
    given = given_group(spec)
    key = spec.key(None if given is None else given[0].id.hex())
    roles, settings = spec.roles, spec.cfg.to_dict()
    need = spec.need if given is None else None   # (a given group: its own bundles, no larger group's)
    kept = pool.take(key, settings, spec.run_name, roles, need=need)
    if kept is not None:
        return kept
    if given is not None:
        pool.release()   # (groups kept in this placement group hold the bundles the new actors need)
        pg, first = given
        timeout_s = limit_s
    else:
        pool.make_room(spec.need)   # (kept groups of other kinds: stopped where the run does not fit)
        try:
            claimed = across.claim(key, spec.mesh.world_size)
        except Exception as e:  # noqa: BLE001 - the registry unreadable: the run starts its own
            logging.getLogger("rayconv").info("rayconv: no kept actors looked up on the cluster (%s)",
                                              exception_summary(e))
            claimed = None
        if claimed is not None:
            actors, names, pg, info = claimed
            group = ActorGroup(actors, roles, pg, info, key=key, names=names, across=True)
            if group.renew(settings, spec.run_name, roles):
                return group
        pg, first = reserve(spec.bundle, spec.mesh.world_size, spec.run_name,
                            limit_s if wait else min(limit_s, RESERVE_S)), None
        timeout_s = max(0.0, limit_s - (time.monotonic() - t0))
    return create_actors(spec.actor_cls, settings, roles, spec.run_name, pg, timeout_s, bundle=spec.bundle,
                         env=spec.env, key=key, limit_s=limit_s, first_bundle=first, wait=wait)

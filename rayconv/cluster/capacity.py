"""The layout against the cluster's devices: how many actors of ``--gpus-per-actor`` GPUs or
``--num-cpus-per-actor`` CPUs the connected cluster holds, ``dp`` where the settings leave it to the cluster,
and what to change where the layout does not fit (a smaller layout, or more devices), after waiting up to
``--max-wait`` for nodes to join a cluster that can grow. No torch here (``driver.early`` and
``driver.resolve`` call it before the driver imports torch).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import ray

from rayconv.cluster.connect import available_devices, cluster_origin, cluster_size
from rayconv.config import Config
from rayconv.errors import ConfigError
from rayconv.mesh import Mesh


def resolve_layout(cfg: Config, log=print, wait: bool = True) -> tuple[Config, Mesh]:
    """``cfg`` with ``device`` and ``dp`` taken from the cluster (validated again: the batch split over
    ``dp``, the GPU-only features), and its mesh, checked to fit. Raises ConfigError.

    On a cluster given by --address or RAY_ADDRESS (one that can grow: autoscaler, nodes joining),
    a layout larger than the cluster waits up to --max-wait seconds for the devices, saying so
    (``wait`` False: never); a local cluster cannot grow, so there the error is immediate."""
    kind, slots = available_devices(cfg.device)
    if kind != "cuda" and cfg.gpus_per_actor != 1:
        raise ConfigError(f"--gpus-per-actor {cfg.gpus_per_actor:g} shares GPUs but the Ray cluster has "
                          "none: drop it (CPU actors take --num-cpus-per-actor)")
    per_actor = cfg.gpus_per_actor if kind == "cuda" else cfg.num_cpus_per_actor
    unit = ("GPUs" if per_actor == 1 else f"GPU shares ({per_actor:g} GPU each)") if kind == "cuda" else \
        f"CPU slots ({per_actor} CPU each)"
    dp = cfg.dp if cfg.dp is not None else max(1, _actors(slots, per_actor) // (cfg.pp * cfg.fs))
    mesh = Mesh(dp, cfg.pp, cfg.fs)
    can_grow = wait and bool(cfg.address or os.environ.get("RAY_ADDRESS"))
    deadline = time.monotonic() + cfg.max_wait
    if mesh.world_size > _actors(slots, per_actor) and can_grow:
        missing = mesh.world_size - _actors(slots, per_actor)
        log(f"rayconv: Ray: {cluster_origin()}: layout {mesh.describe()} needs {mesh.world_size} {unit}, "
            f"{missing} more than it has: waiting up to {cfg.max_wait:.0f} s (--max-wait) for nodes to join")
    while mesh.world_size > _actors(slots, per_actor) and can_grow and time.monotonic() < deadline:
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        slots = available_devices(cfg.device)[1]
    devices = _actors(slots, per_actor)
    if mesh.world_size > devices:
        waited = f" after waiting {cfg.max_wait:.0f} s" if can_grow else ""
        address = ray.get_runtime_context().gcs_address
        raise ConfigError(f"layout {mesh.describe()} needs {mesh.world_size} {unit} but the cluster "
                          f"{address} has {devices} ({cluster_size()}){waited}: "
                          + bigger_or_smaller(mesh, devices, per_actor, kind))
    if (kind, dp) != (cfg.device, cfg.dp):  # (validated again: the batch split over dp, GPU-only features)
        cfg = dataclasses.replace(cfg, device=kind, dp=dp).validate()
    return cfg, mesh


def bigger_or_smaller(mesh: Mesh, devices: int, per_actor: float, kind: str) -> str:
    """What a layout of ``mesh`` that the cluster's ``devices`` actor slots cannot hold can change: a
    smaller layout that fits, or a larger cluster (for CPU actors a head of more logical CPUs)."""
    inner = mesh.pp * mesh.fs
    given = (f" --pp {mesh.pp}" if mesh.pp > 1 else "") + (f" --fs {mesh.fs}" if mesh.fs > 1 else "")
    if devices < 1:
        smaller = ""
    elif inner <= devices:
        smaller = f"use at most {devices} actor(s) (e.g. --dp {devices // inner}{given}), or "
    else:
        smaller = f"use at most {devices} actor(s) (lower --pp/--fs), or "
    join = f"`ray start --address {ray.get_runtime_context().gcs_address}` on another machine"
    if kind == "cuda":
        return f"{smaller}add GPU nodes ({join})"
    cpus = int(math.ceil(mesh.world_size * per_actor))
    return (f"{smaller}give the cluster more: a head of {cpus} logical CPUs (`ray start --head --num-cpus "
            f"{cpus}`, CPUs oversubscribed), or nodes ({join})")


def _actors(slots: int, per_actor: float) -> int:
    """Actors of ``per_actor`` GPUs (a share) or CPUs each that ``slots`` of them hold."""
    return int(slots / per_actor + 1e-9)

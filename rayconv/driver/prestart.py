"""What a run resolves before the driver imports torch: its output folder named and checked, Ray
connected, its layout resolved against the cluster's devices.

``driver.early.start_first`` resolves these before the command and ``rayconv.fit`` import ``driver.job``,
to start the run's actors first; ``driver.resolve`` resolves them again as every run does (the same
checks, in the same order after the layout), reusing the connection. They live here so that this
module imports neither torch nor anything that does (a test imports it in a fresh process and checks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import ray

from rayconv import startup
from rayconv.cluster.connect import available_devices, cluster_origin, cluster_size, connect
from rayconv.config import Config
from rayconv.errors import CheckpointError, ConfigError
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import Checkpoint, find_checkpoint, list_checkpoints
from rayconv.storage import Place, is_uri, place
from rayconv.storage_checks import check_writable
from rayconv.user_model import model_label


def connect_run(cfg: Config) -> None:
    """Connect Ray for the run in progress (``cluster.connect``) and mark the start-up clock's ``ray``
    with how; nothing when this run connected already (``start_first``, then ``driver.resolve``).
    Raises ConfigError / ClusterError as ``connect`` does."""
    clock = startup.current()
    if clock is not None and "ray" in clock.phases and ray.is_initialized():
        return
    min_cpus = cluster_cpus(cfg)
    how = connect(cfg.address, min_cpus=min_cpus)
    startup.mark("ray")
    if clock is not None:
        clock.ray = how


def cluster_cpus(cfg: Config) -> Optional[int]:
    """The logical CPUs a local cluster started for ``cfg`` gets at least (``connect``'s ``min_cpus``):
    one slot per CPU actor (``--dp`` left to the cluster: one replica); None for GPU runs."""
    if cfg.device == "cuda":
        return None
    return (cfg.dp or 1) * cfg.pp * cfg.fs * cfg.num_cpus_per_actor


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


# ---------------------------------------------------------------------- the output folder
def new_run_dir(cfg: Config) -> Path:
    """A new folder under runs/ named by the time, the model and the data."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{model_label(cfg.model)}-{cfg.data}"


def with_output_folder(cfg: Config, resume: Optional[Checkpoint] = None) -> Config:
    """``cfg`` with its output folder named (nothing is made): ``--out``, else the folder of the run
    ``--resume`` continues (``resume``, or found from ``cfg.resume``), else a new one under runs/.
    Raises CheckpointError when ``cfg.resume`` names no checkpoint."""
    if cfg.out:
        return cfg
    if resume is not None:
        out = resume.run_dir
    elif cfg.resume:
        out = find_checkpoint(cfg.resume).parent.parent  # checkpoints/step-<k> of the run folder
    else:
        out = new_run_dir(cfg)
    return dataclasses.replace(cfg, out=str(out))


def output_place(cfg: Config) -> Place:
    """The run's output folder (``cfg.out``, named: ``with_output_folder``) as the run's writers take
    it: a local path in full (``Path``), or a ``storage.Location`` for a URI (``s3://bucket/runs/r1``),
    checked writable before Ray starts (``storage_checks.check_writable``). Raises ConfigError (a relative
    folder under a Ray job), StorageError (one line: a secret in the URI, wrong credentials, a missing
    bucket, an unreachable endpoint, a place that cannot be written)."""
    check_job_output(cfg.out)
    out = place(cfg.out, flag="--out")
    check_writable(cfg.out if isinstance(out, Path) else out, "--out")
    return out.absolute()


def check_output_folder(out: Place, resume: Optional[Checkpoint]) -> None:
    """Refuse an output folder where writing would lose something. Raises CheckpointError (a resumed
    run's folder holds newer checkpoints) or FileExistsError (a file, or a folder holding files)."""
    if resume is not None and out.resolve() == resume.run_dir.resolve():
        newer = [p.name for p in list_checkpoints(out) if int(p.name.split("-")[1]) > resume.step]
        if newer:
            raise CheckpointError(f"--resume {resume.path} is older than {', '.join(newer)} of the same run: "
                                  "resume from the newest, or give --out NEW to branch off from step "
                                  f"{resume.step}")
    elif out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: choose a folder (nothing was overwritten)")
    elif out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} already holds files: choose a new folder (nothing was "
                              "overwritten)")


def ray_job() -> Optional[str]:
    """The Ray job this process is the driver of (``ray job submit``): its submission id, or the working
    folder when that is inside Ray's runtime-env files (``.../session_*/runtime_resources/...``, where
    ``--working-dir`` is unpacked) only: ""; None when it is not run as a Ray job."""
    try:  # the job supervisor gives its driver the job's config (runtime env, metadata) in this variable
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("metadata") or {}
    except (ValueError, AttributeError):
        meta = {}
    if meta.get("job_submission_id"):
        return str(meta["job_submission_id"])
    return "" if "runtime_resources" in Path.cwd().parts else None


def check_job_output(out: str) -> None:
    """Refuse a relative output folder under a Ray job: the job's working folder is Ray's own copy of
    ``--working-dir`` (or the job supervisor's folder), which nobody looks into and Ray deletes; an
    absolute ``--out`` is where the user says. Raises ConfigError."""
    job = ray_job()
    if job is not None and not is_uri(out) and not Path(out).is_absolute():
        where = f"Ray job {job}" if job else "a Ray job"
        raise ConfigError(f"the output folder {out} is relative: under {where} it would be made in the job's "
                          f"working folder {Path.cwd()} (with --working-dir, Ray's temporary copy of it): "
                          "give an absolute --out, e.g. --out /shared/runs/NAME")


def new_run_name(out: Place) -> str:
    """The run's name on the cluster (placement group ``rayconv/<name>``, actors ``rayconv/<name>/<role>``,
    the gauges' ``run`` tag): the output folder's name and a random suffix, e.g. ``r1-3f9a2c``, so that
    runs whose folders share a name (``/tmp/a/run``, ``/tmp/b/run``) can share a cluster."""
    return f"{out.name}-{secrets.token_hex(3)}"

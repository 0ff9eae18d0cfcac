"""What a run resolves before the driver imports torch: its output folder named and checked, Ray
connected (its layout against the cluster's devices: ``cluster.capacity``).

``driver.early.start_first`` resolves these before the command and ``rayconv.fit`` import ``driver.job``,
to start the run's actors first; ``driver.resolve`` resolves them again as every run does (the same
checks, in the same order after the layout), reusing the connection. They live here so that this
module imports neither torch nor anything that does (a test imports it in a fresh process and checks).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from datetime import datetime
from pathlib import Path
from typing import Optional

import ray

from rayconv import startup
from rayconv.cluster.connect import connect
from rayconv.config import Config
from rayconv.errors import CheckpointError, ConfigError
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

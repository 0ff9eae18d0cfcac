"""What a run resolves before the driver imports torch: its output folder named and checked, and the
run's name on the cluster made from it (Ray is connected next: ``cluster.connect.connect_run``).

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

from rayconv.config import Config
from rayconv.errors import ConfigError
from rayconv.outputs.checkpoint import Checkpoint, find_checkpoint
from rayconv.storage import Place, place
from rayconv.storage_checks import check_writable
from rayconv.user_model import model_label


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


def open_output(cfg: Config, resumed_in: Optional[Place] = None) -> tuple[Place, str]:
    """The run's output folder (``cfg.out``, named: ``with_output_folder``) as the run's writers take
    it, checked before Ray starts, and the run's name on the cluster made from it.

    The folder: a local path in full (``Path``), or a ``storage.Location`` for a URI
    (``s3://bucket/runs/r1``), checked writable (``storage_checks.check_writable``) and refused where
    writing would lose something: a file, or a folder holding files, unless it is ``resumed_in`` (the
    folder of the run ``--resume`` continues in place; ``checkpoint.check_resumes_newest`` checks that
    one). The name (placement group ``rayconv/<name>``, actors ``rayconv/<name>/<role>``, the gauges'
    ``run`` tag): the folder's name and a random suffix, e.g. ``r1-3f9a2c``, so that runs whose folders
    share a name (``/tmp/a/run``, ``/tmp/b/run``) can share a cluster. Returns (folder, name). Raises
    ConfigError (a relative folder under a Ray job: its working folder is Ray's copy of ``--working-dir``
    or the job supervisor's folder, which nobody looks into and Ray deletes), StorageError (one line: a
    secret in the URI, wrong credentials, a missing bucket, an unreachable endpoint, a place that cannot
    be written), FileExistsError (a file, or a folder holding files)."""
    job = ray_job()
    loc = check_writable(cfg.out, "--out")
    if job is not None and loc.relative:   # (the job's working folder: Ray's copy, which Ray deletes)
        where = f"Ray job {job}" if job else "a Ray job"
        raise ConfigError(f"the output folder {cfg.out} is relative: under {where} it would be made in the "
                          f"job's working folder {Path.cwd()} (with --working-dir, Ray's temporary copy of "
                          "it): give an absolute --out, e.g. --out /shared/runs/NAME")
    out = place(loc).absolute()
    if resumed_in is None or out.resolve() != resumed_in.resolve():
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"--out {out} is a file: choose a folder (nothing was overwritten)")
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"--out {out} already holds files: choose a new folder (nothing was "
                                  "overwritten)")
    return out, f"{out.name}-{secrets.token_hex(3)}"


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

"""The model checks this machine has seen pass: whether a run may connect Ray and start its actors before
the driver checks its model against the data and the layout.

The checks that need only the model's description (``resolve.check_before_ray``: the model built on the
meta device or traced on the CPU, its image size and class count against the data's, ``--pp`` against its
layers, ``--fs`` against its channels) refuse a run before Ray is connected. They need torch in the driver
(seconds; a torchvision model, torchvision too), which the actors started early import meanwhile
(``driver.early``). So a run checks first, before Ray, unless the same settings passed
these checks on this machine before (``passed``): then its actors start first and the same checks run
while they start, as they would pass again. ``remember`` records a pass: one empty file per settings'
key in ``$RAYCONV_CACHE_DIR/model-checks/`` (default ``~/.cache/rayconv/``).

The key (``key``) is every setting except those the model's checks never read (``UNREAD``: the recipe,
the run's length, its outputs and operation) and the installed rayconv, torch and torchvision versions.
Only passes are kept, so a key that stays the same while something it leaves out changed (a user's model
file, the images under ``--data-dir``) only moves a refusal after Ray starts, where the checks run still.
No torch or Ray here (``driver.early`` imports it before torch).
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

from rayconv.config import Config
from rayconv.files import cache_dir

# The settings the model's checks (the model built for the data, its routing over the layout) never read.
UNREAD = frozenset((
    "epochs steps lr lr_scaling lr_warmup_epochs lr_warmup_method lr_warmup_decay opt lars_trust_coefficient "
    "lr_schedule momentum weight_decay norm_weight_decay bias_weight_decay label_smoothing clip_grad_norm "
    "mixup_alpha cutmix_alpha model_ema model_ema_steps model_ema_decay seed compile cuda_graphs "
    "cudnn_benchmark bucket_mb address collective_timeout_s keep_actors_s out eval_every val_split eval_test "
    "keep_best tensorboard log_images target_accuracy log_every progress metrics checkpoint_every "
    "keep_checkpoints resume max_failures max_wait elastic elastic_wait loader_workers cache_bytes cache_dir "
    "stage_dir shuffle shuffle_window precise_bn_batches"
).split())
FOLDER = "model-checks"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def key(cfg: Config) -> str:
    """The hex sha256 of ``cfg``'s settings that the model's checks read (all but ``UNREAD``) and the
    installed rayconv, torch and torchvision versions."""
    read = {k: v for k, v in cfg.to_dict().items() if k not in UNREAD}
    versions = {p: _version(p) for p in ("rayconv", "torch", "torchvision")}
    return hashlib.sha256(json.dumps([read, versions], sort_keys=True, default=str).encode()).hexdigest()


def _path(cfg: Config) -> Path:
    return cache_dir() / FOLDER / key(cfg)


def passed(cfg: Config) -> bool:
    """Whether the model's checks passed for ``cfg``'s key on this machine (``remember``)."""
    return _path(cfg).exists()


def remember(cfg: Config) -> None:
    """Record that the model's checks passed for ``cfg``; a cache folder that cannot be written is left
    as it is (the next run checks before Ray again)."""
    path = _path(cfg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass

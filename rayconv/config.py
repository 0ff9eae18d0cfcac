"""The run configuration: one flat, frozen dataclass assembled from its sections, and its helpers.

Every field is a flag of ``python -m rayconv.run`` (``global_batch_size`` is ``--global-batch-size``)
and a key of a JSON config file (``--config FILE``; flags given on the command line win). The resolved
configuration is written to ``<out>/config.json`` (flat: one key per flag) and can be passed back with
``--config``.

The fields are declared in sections by concern in ``rayconv.settings`` (``ModelSettings``,
``DataSettings``, ``LayoutFields`` and ``LayoutSettings``, ``RecipeSettings``, ``ExecutionSettings``,
``ClusterSettings``, ``OutputSettings``, ``OperationsSettings``); ``Config`` inherits them all, so a
setting is read flat (``cfg.lr``), its name is its flag's, and a function may annotate the section it
reads. ``LayoutFields`` are also the fields of ``rayconv.layout.Layout``.

Errors a user can cause raise :class:`ConfigError` (a ``ValueError``) whose message names the flag
and what to change; the checks live in ``rayconv.config_checks``. A Config is frozen: ``validate()``
checks it and returns it; what the driver resolves later (the device, ``dp``, the pipeline cut, the
output folder) makes a new one with ``dataclasses.replace``. The module imports only ``errors``,
``choices`` (the flags' named choices), ``settings``, ``config_checks`` and ``data_dir`` (a shard
folder's stored image side), so that every layer can read settings;
the flags are built from the fields by ``rayconv.flags``, and ``--resume``'s checkpoint is read by the
command line (``rayconv.run``).

The recipe flags keep the names of torchvision's reference script (references/classification/train.py:
``--opt``, ``--lr-warmup-*``, ``--label-smoothing``, ``--norm-weight-decay``, ``--model-ema*``,
``--mixup-alpha``, ``--cutmix-alpha``, ``--random-erase``, ``--clip-grad-norm``); their defaults leave
a run as plain SGD with momentum, cosine decay and no warm-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayconv.choices import DATA_IMAGE_SIZE, PAD_CROP_MAX_SIZE
from rayconv.config_checks import batch_split_problem, check  # noqa: F401 (batch_split_problem re-exported)
from rayconv.data_dir import raw_side
from rayconv.errors import ConfigError  # noqa: F401 (re-exported: callers catch it from here)
from rayconv.settings import (ClusterSettings, DataSettings, ExecutionSettings, LayoutSettings, ModelSettings,
                              OperationsSettings, OutputSettings, RecipeSettings)


@dataclass(frozen=True)
class Config(OperationsSettings, OutputSettings, ClusterSettings, ExecutionSettings, RecipeSettings,
             LayoutSettings, DataSettings, ModelSettings):
    """Settings of one training run, flat (``cfg.lr``) and frozen (``dataclasses.replace`` makes a
    changed copy). Units are given per field. Its sections are its bases, listed last first: a
    dataclass takes the fields of its last base first, so the flags keep this file's order."""

    def validate(self) -> "Config":
        """Check what can be checked without a cluster or data, once (a Config is frozen: a later call
        returns at once); return self. Raises ConfigError naming the flag and what to change."""
        if not self.__dict__.get("_validated"):  # (dataclasses.replace makes a new, unchecked Config)
            check(self)
            object.__setattr__(self, "_validated", True)
        return self

    @property
    def failure_budget(self) -> int:
        """Actor failures a run recovers from (-1: any number): ``max_failures``, else 0, or -1 with
        ``elastic`` (an elastic run is meant to survive losses; below MIN it stops, ``TooFewDevices``)."""
        if self.max_failures is not None:
            return self.max_failures
        return -1 if self.elastic is not None else 0

    @property
    def world_size(self) -> int:
        """Actors in the mesh: dp * pp * fs (dp must be resolved)."""
        assert self.dp is not None, "dp is resolved against the cluster first"
        return self.dp * self.pp * self.fs

    @property
    def data_image_size(self) -> int:
        """Side in pixels of the training images: ``image_size``, else the data's own: a raw-pixel shard
        folder's stored side, else ``DATA_IMAGE_SIZE``."""
        if self.image_size is not None:
            return self.image_size
        side = raw_side(self.data_dir) if self.data == "shards" else None
        return side if side is not None else DATA_IMAGE_SIZE.get(self.data, 224)

    @property
    def raw_pixels(self) -> bool:
        """Whether the data are raw-pixel shards (``prepare --encoding raw``): read as stored, never
        decoded."""
        return self.data == "shards" and raw_side(self.data_dir) is not None

    @property
    def augmentation(self) -> str:
        """The augmentation ``augment`` names, ``auto`` resolved by the image side: ``pad-crop`` up to
        ``PAD_CROP_MAX_SIZE`` pixels (small images, as CIFAR's recipe), ``resized-crop`` above
        (ImageNet's)."""
        if self.augment != "auto":
            return self.augment
        return "pad-crop" if self.data_image_size <= PAD_CROP_MAX_SIZE else "resized-crop"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: Path) -> None:
        """Write the settings to ``path`` (a Path, or a ``storage.Location``), whole or absent."""
        from rayconv.files import write_json
        write_json(path, self.to_dict())

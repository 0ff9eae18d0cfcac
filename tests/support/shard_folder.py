"""A small prepared shard folder for the tests of ``--shuffle block`` and ``--stage-dir``: real JPEGs
written with PIL, two classes, prepared in this process (``shard_writer.prepare``, the shards
``python -m rayconv.prepare`` writes with Ray tasks, without starting a Ray worker per task)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from rayconv.data.shard_writer import prepare

CLASSES = ("cat", "dog")


def make_prepared(root: Path, train_per_class: int = 8, val_per_class: int = 2, shard_size: int = 4) -> Path:
    """``root/src`` (train/<class>/, val/<class>/ of JPEGs, class c brighter in channel c) prepared into
    ``root/shards`` (shorter side 40, ``shard_size`` images a shard, in prepare's default seeded order:
    the train shards mix cats and dogs); returns the shard folder."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c, name in enumerate(CLASSES):
            d = root / "src" / split / name
            d.mkdir(parents=True)
            for i in range(n):
                px = rng.integers(0, 90, (36 + 3 * i, 48, 3)).astype(np.uint8)
                px[..., c] += 160
                Image.fromarray(px).save(d / f"{name}{i}.jpg", quality=90)
    out = root / "shards"
    prepare(str(root / "src"), str(out), size=40, shard_size=shard_size, processes=1, log=lambda *_: None)
    return out

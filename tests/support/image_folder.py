"""A tiny ImageNet-layout folder for the tests of ``--data-on-device``: random RGB images of several
sizes (one grey image a class), written with PIL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_folder(root: Path, suffix: str = ".png", train: int = 5, val: int = 2) -> Path:
    """root/train/<a|b>/ and root/val/<a|b>/ with ``train`` and ``val`` images a class (``suffix``
    .png or .jpg), of sizes 36-56 x 36-48, the second of each class grey; returns root."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                px = rng.integers(0, 256, (36 + 5 * i, 48 - 3 * i, 3), dtype=np.uint8)
                img = Image.fromarray(px).convert("L") if i == 1 else Image.fromarray(px)
                img.save(root / split / cls / f"{i}{suffix}", **({"quality": 90} if suffix == ".jpg" else {}))
    return root

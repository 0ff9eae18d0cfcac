"""A tiny ImageNet-layout folder for the tests: RGB images, one class folder a letter, written with
PIL (by default random images of several sizes, one grey image a class)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
from PIL import Image


def noise(rng: np.random.Generator, c: int, i: int, shape: tuple[int, int, int]) -> np.ndarray:
    """Uniform random uint8 pixels of ``shape`` (the default ``pixels`` of ``write_folder``)."""
    return rng.integers(0, 256, shape, dtype=np.uint8)


def write_folder(root: Path, suffix: str = ".png", train: int = 5, val: int = 2, classes: str = "ab",
                 shape: Optional[Callable[[int], tuple[int, int]]] = None,
                 pixels: Callable[..., np.ndarray] = noise, grey: bool = True) -> Path:
    """root/train/<class>/ and root/val/<class>/, one class a letter of ``classes``, with ``train`` and
    ``val`` images a class (``suffix`` .png or .jpg), drawn split by split, class by class, from one
    random generator (seed 0). ``shape(i)``: the i-th image's (height, width) (default 36 + 5i x
    48 - 3i); ``pixels(rng, class index, i, (height, width, 3))``: its uint8 pixels (default
    ``noise``); ``grey``: the second image of each class saved grey. Returns root."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for c, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                h, w = shape(i) if shape is not None else (36 + 5 * i, 48 - 3 * i)
                img = Image.fromarray(pixels(rng, c, i, (h, w, 3)))
                img = img.convert("L") if grey and i == 1 else img
                img.save(root / split / cls / f"{i}{suffix}", **({"quality": 90} if suffix == ".jpg" else {}))
    return root

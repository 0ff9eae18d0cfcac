"""Write an ImageNet-like JPEG folder for benchmarking real-data input, with no download.

    python benchmarks/make_images.py DIR --classes 100 --train-per-class 1300 --val-per-class 50

writes ``DIR/train/<class>/<class>_<i>.JPEG`` and ``DIR/val/<class>/...`` (the layout of
``--data imagefolder``): RGB, ``--width`` x ``--height`` (default 500 x 375, ImageNet's most common
size), JPEG quality 90. The content is procedural: smooth colour fields at several scales, a few
shapes and edges, and fine texture and sensor-like noise, so that a file is about as large as an
ImageNet photo of that size (about 65 KB at the defaults) and decodes about as slowly. Each image depends only on
(``--seed``, split, class, index): the same command writes the same bytes. Written in parallel over
``--processes`` processes (numpy and PIL only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


_NOISE: dict = {}  # (height, width) -> a bank of sensor-like noise, twice the image's sides, per process


def _noise(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """(height, width, 3) float32 Gaussian noise (sd 9): a window of this process's bank at a random offset,
    so that each image gets distinct noise without drawing a fresh field (the dearest step otherwise)."""
    bank = _NOISE.get((height, width))
    if bank is None:
        bank = _NOISE[(height, width)] = np.random.default_rng([height, width]).standard_normal(
            (2 * height, 2 * width, 3), dtype=np.float32) * np.float32(9)
    y, x = rng.integers(0, height), rng.integers(0, width)
    return bank[y:y + height, x:x + width]


def make_image(seed: int, split: str, cls: int, index: int, width: int, height: int) -> Image.Image:
    """One procedural RGB image (``height`` x ``width``), a function of its arguments only."""
    import zlib

    rng = np.random.default_rng([seed, zlib.crc32(split.encode()), cls, index])
    base = np.random.default_rng([seed, cls]).uniform(40, 215, 3)  # the class's colour cast
    img = np.zeros((height, width, 3), np.float32)
    # Smooth fields at several scales (a coarse random grid, upsampled bicubically, 3 channels at once).
    for cells, amp in ((3, 60.0), (8, 35.0), (24, 18.0)):
        grid = rng.normal(0, amp, (cells, max(2, cells * width // height), 3))
        coarse = Image.fromarray(np.clip(grid * (127 / (3 * amp)) + 128, 0, 255).astype(np.uint8), "RGB")
        img += (np.asarray(coarse.resize((width, height), Image.BICUBIC), np.float32) - 128) * np.float32(3 * amp / 127)
    img += base.astype(np.float32)
    # A few hard-edged shapes (objects, edges), each drawn in its bounding box only.
    for _ in range(rng.integers(2, 6)):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(20, height / 2), rng.uniform(20, width / 2)
        colour = (rng.uniform(0, 255, 3) * 0.6).astype(np.float32)
        y0, y1 = max(0, int(cy - ry)), min(height, int(cy + ry) + 1)
        x0, x1 = max(0, int(cx - rx)), min(width, int(cx + rx) + 1)
        yy = (np.arange(y0, y1, dtype=np.float32)[:, None] - np.float32(cy)) / np.float32(ry)
        xx = (np.arange(x0, x1, dtype=np.float32)[None, :] - np.float32(cx)) / np.float32(rx)
        box = img[y0:y1, x0:x1]
        inside = yy ** 2 + xx ** 2 < 1
        box[inside] = box[inside] * np.float32(0.4) + colour
    # Fine texture (oriented stripes) and per-pixel noise: the high frequencies that make JPEGs large.
    theta, freq = rng.uniform(0, np.pi), rng.uniform(0.15, 0.6)
    yy = np.arange(height, dtype=np.float32)[:, None]
    xx = np.arange(width, dtype=np.float32)[None, :]
    img += 14 * np.sin(np.float32(freq) * (xx * np.float32(np.cos(theta)) + yy * np.float32(np.sin(theta))))[..., None]
    img += _noise(rng, height, width)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def _write_class(job: tuple) -> int:
    root, split, cls, count, seed, width, height, quality = job
    folder = Path(root) / split / f"n{cls:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    size = 0
    for i in range(count):
        path = folder / f"n{cls:08d}_{i}.JPEG"
        tmp = path.with_name("." + path.name)
        make_image(seed, split, cls, i, width, height).save(tmp, "JPEG", quality=quality)
        os.replace(tmp, path)  # never a half-written image
        size += path.stat().st_size
    return size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/make_images.py", description=__doc__.split("\n")[0])
    p.add_argument("out", help="folder to write (train/ and val/ inside)")
    p.add_argument("--classes", type=int, default=100, help="number of classes (default %(default)s)")
    p.add_argument("--train-per-class", type=int, default=100, help="training images per class (default %(default)s)")
    p.add_argument("--val-per-class", type=int, default=10, help="held-out images per class (default %(default)s)")
    p.add_argument("--width", type=int, default=500, help="pixels (default %(default)s)")
    p.add_argument("--height", type=int, default=375, help="pixels (default %(default)s)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes the same files (default %(default)s)")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="parallel writers (default: the CPU count, %(default)s)")
    a = p.parse_args(argv)
    for name in ("classes", "width", "height", "processes"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.train_per_class < 1 or a.val_per_class < 1:
        p.error("--train-per-class and --val-per-class must be at least 1 (every class folder needs an image)")
    if not 1 <= a.quality <= 100:
        p.error("--quality must be within 1..100")
    jobs = [(a.out, split, c, n, a.seed, a.width, a.height, a.quality)
            for split, n in (("train", a.train_per_class), ("val", a.val_per_class)) for c in range(a.classes)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.processes) as pool:
        total = sum(pool.map(_write_class, jobs))
    count = a.classes * (a.train_per_class + a.val_per_class)
    print(f"{count} images, {total / count / 1e3:.0f} KB each on average, {time.perf_counter() - t0:.1f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

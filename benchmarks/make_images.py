"""Write an ImageNet-like JPEG folder for benchmarking real-data input, with no download.

    python benchmarks/make_images.py DIR --classes 100 --train-per-class 1300 --val-per-class 50

writes ``DIR/train/<class>/<class>_<i>.JPEG`` and ``DIR/val/<class>/...`` (the layout of
``--data imagefolder``): RGB, ``--width`` x ``--height`` (default 500 x 375, ImageNet's most common
size), JPEG quality 90 (``--format png``: lossless PNGs). The content is procedural: smooth colour fields at
several scales, a few shapes and edges, and fine texture and sensor-like noise, so that a file is about as
large as an ImageNet photo of that size (about 65 KB at the defaults) and decodes about as slowly. Each image
depends only on (``--seed``, split, class, index): the same command writes the same bytes. Written in parallel
over ``--processes`` processes (numpy and PIL only).
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


_BANKS: dict = {}  # (height, width) -> this process's int16 noise and stripe-texture banks


def _banks(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """int16 banks for images of ``height`` x ``width``: sensor-like Gaussian noise (sd 9) twice the image's
    sides, read through a window at a random offset, and stripe textures (amplitude 14) at 16 angles x 8
    spatial frequencies, so that no image computes a full-size random field or sine (the dearest steps)."""
    banks = _BANKS.get((height, width))
    if banks is None:
        noise = np.random.default_rng([height, width]).standard_normal((2 * height, 2 * width, 3),
                                                                       dtype=np.float32)
        yy = np.arange(height, dtype=np.float32)[:, None]
        xx = np.arange(width, dtype=np.float32)[None, :]
        stripes = np.empty((16, 8, height, width, 1), np.int16)
        for a in range(16):
            theta = (a + 0.5) * np.pi / 16
            for f in range(8):
                freq = 0.15 + 0.45 * (f + 0.5) / 8
                wave = np.sin(
                    np.float32(freq) * (xx * np.float32(np.cos(theta)) + yy * np.float32(np.sin(theta))))
                stripes[a, f, ..., 0] = (14 * wave).round()
        banks = _BANKS[(height, width)] = ((noise * 9).round().astype(np.int16), stripes)
    return banks


def make_image(seed: int, split: str, cls: int, index: int, width: int, height: int) -> Image.Image:
    """One procedural RGB image (``height`` x ``width``), a function of its arguments only."""
    import zlib

    rng = np.random.default_rng([seed, zlib.crc32(split.encode()), cls, index])
    base = np.random.default_rng([seed, cls]).uniform(40, 215, 3)  # the class's colour cast
    noise, stripes = _banks(height, width)
    # Smooth fields at three scales (random grids of 3, 8 and 24 rows), summed on the finest grid and
    # upsampled to the image bicubically once.
    fine = (24, max(2, 24 * width // height))
    field = np.zeros((*fine, 3), np.float32)
    for cells, amp in ((3, 60.0), (8, 35.0), (24, 18.0)):
        grid = rng.normal(0, amp, (cells, max(2, cells * width // height), 3)).astype(np.float32)
        if cells != fine[0]:
            grid = np.stack([np.asarray(Image.fromarray(grid[..., c], "F").resize(fine[::-1], Image.BICUBIC))
                             for c in range(3)], -1)
        field += grid
    field += base.astype(np.float32)
    smooth = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8), "RGB").resize((width, height),
                                                                                    Image.BICUBIC)
    img = np.asarray(smooth).astype(np.int16)
    # A few hard-edged shapes (objects, edges), each drawn in its bounding box only.
    for _ in range(rng.integers(2, 6)):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        # (radii from 20 pixels; from a quarter of the side on images under 40 pixels)
        ry = rng.uniform(20 if height >= 40 else height / 4, height / 2)
        rx = rng.uniform(20 if width >= 40 else width / 4, width / 2)
        colour = (rng.uniform(0, 255, 3) * 0.6).astype(np.int16)
        y0, y1 = max(0, int(cy - ry)), min(height, int(cy + ry) + 1)
        x0, x1 = max(0, int(cx - rx)), min(width, int(cx + rx) + 1)
        yy = (np.arange(y0, y1, dtype=np.float32)[:, None] - np.float32(cy)) / np.float32(ry)
        xx = (np.arange(x0, x1, dtype=np.float32)[None, :] - np.float32(cx)) / np.float32(rx)
        box = img[y0:y1, x0:x1]
        inside = yy ** 2 + xx ** 2 < 1
        box[inside] = box[inside] * 2 // 5 + colour
    # Fine texture (oriented stripes) and per-pixel noise: the high frequencies that make JPEGs large.
    img += stripes[rng.integers(0, 16), rng.integers(0, 8)]
    y, x = rng.integers(0, height), rng.integers(0, width)
    img += noise[y:y + height, x:x + width]
    return Image.fromarray(np.clip(img, 0, 255, out=img).astype(np.uint8), "RGB")


def _write_class(job: tuple) -> int:
    root, split, cls, count, seed, width, height, quality, *fmt = job
    fmt = fmt[0] if fmt else "jpeg"
    folder = Path(root) / split / f"n{cls:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    size = 0
    for i in range(count):
        path = folder / f"n{cls:08d}_{i}.{'png' if fmt == 'png' else 'JPEG'}"
        tmp = path.with_name("." + path.name)
        img = make_image(seed, split, cls, i, width, height)
        img.save(tmp, "PNG") if fmt == "png" else img.save(tmp, "JPEG", quality=quality)
        os.replace(tmp, path)  # never a half-written image
        size += path.stat().st_size
    return size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/make_images.py", description=__doc__.split("\n")[0])
    p.add_argument("out", help="folder to write (train/ and val/ inside)")
    p.add_argument("--classes", type=int, default=100, help="number of classes (default %(default)s)")
    p.add_argument("--train-per-class", type=int, default=100,
                   help="training images per class (default %(default)s)")
    p.add_argument("--val-per-class", type=int, default=10,
                   help="held-out images per class (default %(default)s)")
    p.add_argument("--width", type=int, default=500, help="pixels (default %(default)s)")
    p.add_argument("--height", type=int, default=375, help="pixels (default %(default)s)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default %(default)s)")
    p.add_argument("--format", choices=("jpeg", "png"), default="jpeg",
                   help="jpeg (default) or png (lossless, .png files)")
    p.add_argument("--seed", type=int, default=0,
                   help="the same seed writes the same files (default %(default)s)")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="parallel writers (default: the CPU count, %(default)s)")
    a = p.parse_args(argv)
    for name in ("classes", "width", "height", "processes"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.train_per_class < 1 or a.val_per_class < 1:
        p.error(
            "--train-per-class and --val-per-class must be at least 1 (every class folder needs an image)")
    if not 1 <= a.quality <= 100:
        p.error("--quality must be within 1..100")
    jobs = [(a.out, split, c, n, a.seed, a.width, a.height, a.quality, a.format)
            for split, n in (("train", a.train_per_class), ("val", a.val_per_class))
            for c in range(a.classes)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.processes) as pool:
        total = sum(pool.map(_write_class, jobs))
    count = a.classes * (a.train_per_class + a.val_per_class)
    print(
        f"{count} images, {total / count / 1e3:.0f} KB each on average, {time.perf_counter() - t0:.1f} s ->"
        f" {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a raw-pixel shard folder (``rayconv-shards/3``, what ``python -m rayconv.prepare --encoding raw``
writes) of generated images straight from pixel arrays, with no image files in between:

    python benchmarks/make_raw_shards.py OUT --images 1280000 --size 32 --classes 1000 --val 10000

gives OUT/train-*.arrow (``--images`` images), OUT/val-*.arrow (``--val``) and OUT/manifest.json, for
``--data shards --data-dir OUT`` (e.g. an ImageNet-32-sized set, 1.28 M images of 32 x 32, to stream a
set larger than what is held on the device). Each shard is written by the project's shard writer
(``rayconv/data/shard_table.py``: ``write_rows``, atomic, its sha256 in the manifest, written last), one
process per shard (``--processes``, default all cores); ``--shard-size`` defaults to prepare's for raw
pixels (``rayconv.prepare.default_shard_size``).

An image of class c is c's pattern (``class_patterns``: a seeded 4 x 4 x 3 grid of levels in [32, 223]
scaled up to S x S) plus uniform noise in [0, 31] per byte; labels are drawn uniformly at random, so that
every shard mixes the classes (as prepare's shuffled train order). Everything is a function of
(``--seed``, split, shard): the same command writes the same bytes (``shard_images`` says which). OUT must
be new or empty; one written by the same command is kept as it is. The path column is null (there is no
source file). Exit status 2 with a one-line message for bad arguments or an OUT holding other files, 1 for
an OSError (a full disk).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rayconv.data.folders import SPLITS  # noqa: E402
from rayconv.data.shard_files import MANIFEST, SUFFIX  # noqa: E402
from rayconv.data.shard_table import make_manifest, write_manifest, write_rows  # noqa: E402
from rayconv.data.shard_writer import split_summary  # noqa: E402
from rayconv.errors import DataError  # noqa: E402
from rayconv.prepare import default_shard_size  # noqa: E402

GRID = 4          # a class pattern's cells per side
LEVELS = (32, 224)  # a pattern byte's range [lo, hi); plus noise < NOISE it stays below 256
NOISE = 32          # noise per byte: uniform in [0, NOISE), NOISE a power of two (masked random bits)
_SPLIT_CODE = {"train": 0, "val": 1}


def class_patterns(seed: int, size: int, classes: int) -> np.ndarray:
    """uint8 (classes, size, size, 3): class c's GRID x GRID x 3 levels (seeded by (seed, classes)),
    each cell scaled up to a block of about size / GRID pixels."""
    grid = np.random.default_rng([seed, classes]).integers(*LEVELS, (classes, GRID, GRID, 3), dtype=np.uint8)
    cells = np.arange(size) * GRID // size
    return grid[:, cells][:, :, cells]


def shard_images(seed: int, split: str, shard: int, n: int, size: int, classes: int,
                 patterns: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """Shard ``shard`` of ``split`` (train or val): labels int64 (n,) uniform over ``classes`` and pixels
    uint8 (n, size, size, 3) = the label's pattern + noise, drawn from numpy's PCG64 seeded by (seed,
    split, shard). ``patterns``: ``class_patterns(seed, size, classes)``, made here when not given."""
    if patterns is None:
        patterns = class_patterns(seed, size, classes)
    rng = np.random.default_rng([seed, _SPLIT_CODE[split], shard])
    labels = rng.integers(0, classes, n)
    nbytes = n * size * size * 3
    noise = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes].reshape(n, size, size, 3)
    pixels = patterns[labels]
    pixels += noise & np.uint8(NOISE - 1)
    return labels, pixels


def _write_shard(out: str, split: str, shard: int, start: int, n: int, settings: dict[str, Any],
                 classes: int, source: str) -> dict[str, Any]:
    """Generate and write ``split``-``shard`` (rows ``start`` .. ``start + n`` of the split); its entry."""
    import pyarrow as pa

    size, seed = settings["size"], settings["seed"]
    labels, pixels = shard_images(seed, split, shard, n, size, classes)
    rows = {"index": np.arange(start, start + n), "label": labels.astype(np.int32),
            "height": np.full(n, size, np.int32), "width": np.full(n, size, np.int32), "pixels": pixels,
            "path": pa.nulls(n, pa.string())}
    inputs = hashlib.sha256(json.dumps([source, split, shard, start, n]).encode()).hexdigest()
    final = Path(out) / f"{split}-{shard:05d}{SUFFIX}"
    return write_rows(final, rows, {"settings": settings, "inputs_sha256": inputs}, [], size)


def generate(out: str, images: int, size: int, classes: int, val: int, shard_size: Optional[int] = None,
             seed: int = 0, processes: Optional[int] = None, log=print) -> dict[str, Any]:
    """Write the folder ``out`` (module docstring); returns its manifest. ``processes`` 1 writes in this
    process. Raises DataError for an ``out`` holding other files, ValueError for a count below 1."""
    shard_size = shard_size or default_shard_size("raw", size)
    for name, v in (("--images", images), ("--val", val), ("--classes", classes), ("--size", size),
                    ("--shard-size", shard_size), ("--processes", processes or 1)):
        if v < 1:
            raise ValueError(f"{name} must be at least 1 (got {v})")
    settings = {"size": size, "quality": None, "shard_size": shard_size, "shard_order": "shuffled",
                "seed": seed, "encoding": "raw"}
    source = (
        f"generated by benchmarks/make_raw_shards.py --images {images} --size {size} --classes {classes} "
        f"--val {val} --seed {seed}")
    dest = Path(out)
    if (dest / MANIFEST).is_file():
        old = json.loads((dest / MANIFEST).read_text())
        if old.get("source") == source and old.get("settings") == settings:
            log(f"make_raw_shards: {dest} already holds this set: kept")
            return old
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DataError(f"{dest} is not a new or empty folder: remove it or give another OUT")
    dest.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = [(split, k, start, min(shard_size, count - start))
            for split, count in (("train", images), ("val", val))
            for k, start in enumerate(range(0, count, shard_size))]
    args = [(str(dest), split, k, start, n, settings, classes, source) for split, k, start, n in jobs]
    if (processes or os.cpu_count() or 1) == 1:
        entries = [_write_shard(*a) for a in args]
    else:
        with ProcessPoolExecutor(min(len(args), processes or os.cpu_count() or 1)) as pool:
            entries = list(pool.map(_write_shard, *zip(*args)))
    names = [f"class{c:0{len(str(classes - 1))}d}" for c in range(classes)]
    splits = {
        folder: split_summary(
            folder,
            [e for (s, *_), e in zip(jobs, entries) if s == folder],
            names,
            [],
            images if folder == "train" else val,
            dest,
            log,
        )
        for folder in SPLITS.values()
    }
    manifest = make_manifest(source, settings, names, splits)
    write_manifest(dest, manifest)
    wall = time.perf_counter() - t0
    total = images + val
    log(
        f"make_raw_shards: {images} train and {val} val images ({size}x{size}, {classes} classes) in"
        f" {len(jobs)} shards -> {dest}: {wall:.1f} s, {total / wall:.0f} images/s,"
        f" {sum(e['bytes'] for e in entries) / wall / 2**20:.0f} MiB/s"
    )
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/make_raw_shards.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("out", help="the folder to write (new or empty)")
    p.add_argument("--images", type=int, required=True, help="train images")
    p.add_argument("--size", type=int, default=32, help="pixels per side (default %(default)s)")
    p.add_argument("--classes", type=int, default=1000, help="number of classes (default %(default)s)")
    p.add_argument("--val", type=int, default=10000, help="val images (default %(default)s)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="images per shard (default: prepare's for raw pixels)")
    p.add_argument("--seed", type=int, default=0,
                   help="the same seed writes the same bytes (default %(default)s)")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="shards written at once (default: all cores, %(default)s)")
    a = p.parse_args(argv)
    try:
        generate(a.out, a.images, a.size, a.classes, a.val, a.shard_size, a.seed, a.processes)
    except ValueError as e:   # (DataError is one): bad arguments or OUT
        print(f"make_raw_shards: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:      # e.g. the disk is full (no half-written shard or manifest is left)
        print(f"make_raw_shards: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

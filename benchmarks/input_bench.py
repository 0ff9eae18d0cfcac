"""Decode + augment rates of rayconv's input paths, in images/s into the 224 x 224 training tensors.

    python benchmarks/input_bench.py --out benchmarks/input-latest   # one GPU (about 1-2 min)
    python benchmarks/input_bench.py --device cpu --images 64 --batch 16 --workers 1 --out /tmp/ib   # CPU

No Ray, no downloads: it writes an ImageNet-like folder of ``--images`` JPEGs (500 x 375, quality 90,
about 75 KB each: smooth colour fields plus noise, made with numpy and Pillow) into a temporary folder,
prepares it twice with ``rayconv.prepare`` on local processes (shorter side 256, and at full size),
then times each path over the same samples at ``--batch`` per batch, exactly as an actor asks for its
batches (all announced first, then taken one by one; the first batch, which starts the loader's
processes and nvJPEG, is not timed; the GPU is synchronised at the end). Figures, one line each:

* ``imagefolder-pil``: ``--data imagefolder``, torchvision ImageFolder + PIL + RandomResizedCrop in
  ``--workers`` DataLoader processes, float tensors copied to the device;
* ``imagefolder-pil-draft``: the same with Pillow's JPEG draft mode (DCT-domain downscale by 1/2, 1/4
  or 1/8, never below 224 x 224): a candidate for the imagefolder path;
* ``shards-cpu``: prepared shards, libjpeg-turbo decode + crop + flip in ``--workers`` processes, uint8
  copied to the device and normalised there;
* ``shards-gpu``: prepared shards, batched nvJPEG + per-sample crop + flip + normalise on the GPU;
* ``nvjpeg-only``: the batched nvJPEG decode of the prepared shards alone (no crop), for reference;
* ``full-gpu`` / ``full-cpu``: the same GPU / CPU paths on the 500 x 375 JPEGs re-encoded at full size.

It writes ``input_bench.parquet`` and ``input_bench.md`` (one row per figure) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _write_images(args: tuple[str, int, int, int, int]) -> None:
    """``count`` JPEGs into ``folder`` (one class folder), from seed ``seed``."""
    from PIL import Image

    folder, first, count, seed, side = args
    rng = np.random.default_rng(seed)
    w, h = side, side * 3 // 4
    Path(folder).mkdir(parents=True, exist_ok=True)
    for i in range(first, first + count):
        base = (rng.random((36, 48, 3)) * 255).astype(np.uint8)
        img = np.asarray(Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
        img += rng.normal(0, 8.0, img.shape).astype(np.float32)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(Path(folder) / f"img{i:06d}.JPEG",
                                                                    quality=90)


def make_folder(root: Path, n_train: int, n_val: int, classes: int, side: int, processes: int) -> None:
    """An ImageNet-layout folder: train/<class>/ and val/<class>/ JPEGs of side x side * 3 / 4 pixels."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = []
    for split, n in (("train", n_train), ("val", n_val)):
        per = max(1, n // classes)
        for c in range(classes):
            for first in range(0, per, 64):
                jobs.append((str(root / split / f"c{c:03d}"), first, min(64, per - first),
                             zlib.crc32(f"{split}{c}-{first}".encode()), side))
    with ProcessPoolExecutor(processes) as pool:
        list(pool.map(_write_images, jobs))


def time_source(source, batches: list[np.ndarray], device, sync) -> tuple[float, int]:
    """Seconds and images for all batches but the first, taken from ``source`` as an actor does."""
    import torch

    source.prefetch("train", 0, batches)
    source.images("train", batches[0], device, 0, dtype=torch.float32)
    sync()
    t0 = time.perf_counter()
    for b in batches[1:]:
        x = source.images("train", b, device, 0, dtype=torch.float32)
    sync()
    assert x.shape[1:] == source.sample_shape, x.shape
    return time.perf_counter() - t0, sum(len(b) for b in batches[1:])


def draft_loader(size: int):
    """ImageFolder's loader with Pillow's JPEG draft mode: decode at the smallest DCT scale that keeps
    both sides >= size (no gain unless an image is at least twice that on its shorter side)."""
    def load(path: str):
        from PIL import Image

        with open(path, "rb") as f:
            img = Image.open(f)
            img.draft("RGB", (size, size))
            return img.convert("RGB")
    return load


def parse_flags(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where batches go (cuda: the GPU figures too)")
    p.add_argument("--images", type=int, default=4096, help="train images written and read per figure")
    p.add_argument("--batch", type=int, default=256, help="images per batch")
    p.add_argument("--size", type=int, default=224, help="training crop side in pixels")
    p.add_argument("--side", type=int, default=500, help="width of the generated JPEGs (height 3/4 of it)")
    p.add_argument("--workers", type=int, default=os.cpu_count(),
                   help="DataLoader processes for the CPU paths")
    p.add_argument("--classes", type=int, default=16, help="class folders")
    p.add_argument("--out", default="benchmarks/input-latest", help="folder for input_bench.parquet and .md")
    p.add_argument("--tmp", default=None, help="where to write the images (default: a temporary folder)")
    return p.parse_args(argv)


def write_and_prepare(a: argparse.Namespace, tmp: str, device, procs: int) -> tuple[Path, list[Path], float]:
    """The JPEG folder under ``tmp``/images and its two prepared copies (``s256``, ``full``); returns the
    folder, its train files and their mean size in KB."""
    import torch

    from rayconv.data.shard_writer import prepare  # (kept out of --help's path, as torch is)

    root = Path(tmp) / "images"
    t0 = time.perf_counter()
    make_folder(root, a.images, max(a.classes, a.images // 16), a.classes, a.side, procs)
    files = sorted(root.glob("train/*/*.JPEG"))
    kb = np.mean([f.stat().st_size for f in files]) / 1e3
    print(f"# {len(files)} train JPEGs of {a.side}x{a.side * 3 // 4}, {kb:.0f} KB each, written in "
          f"{time.perf_counter() - t0:.1f} s; torch {torch.__version__}; {procs} CPUs; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""), flush=True)
    quiet = lambda *_: None  # noqa: E731
    t0 = time.perf_counter()
    prepare(str(root), str(Path(tmp) / "s256"), size=256, shard_size=512, log=quiet, processes=procs)
    print(f"# prepared at 256 in {time.perf_counter() - t0:.1f} s on {procs} processes", flush=True)
    prepare(str(root), str(Path(tmp) / "full"), size=1 << 16, shard_size=512, log=quiet, processes=procs)
    return root, files, kb


class Figures:
    """The rows of ``input_bench.parquet``, each printed as it is recorded."""

    def __init__(self, device, batch: int, kb: float):
        self.device, self.batch, self.kb = device, batch, kb
        self.rows: list[dict] = []

    def record(self, figure: str, what: str, seconds: float, images: int, workers=None) -> None:
        row = {"figure": figure, "what": what, "device": str(self.device), "workers": workers,
               "batch": self.batch, "images": images, "seconds": seconds, "images_per_s": images / seconds,
               "source_kb": self.kb}
        self.rows.append(row)
        print(f"{figure:24s} {row['images_per_s']:10.0f} images/s   ({what}; {images} images in "
              f"{seconds:.2f} s)", flush=True)


def time_cpu_paths(a: argparse.Namespace, root: Path, tmp: str, batches: list[np.ndarray], sync,
                   figs: Figures) -> None:
    """The figures of the CPU decode paths: imagefolder-pil(-draft), shards-cpu, full-cpu."""
    from rayconv.data.imagefolder import ImageFolderSource  # (kept out of --help's path, as torch is)
    from rayconv.data.shards import ShardSource

    for figure, loader in (("imagefolder-pil", None), ("imagefolder-pil-draft", draft_loader(a.size))):
        src = ImageFolderSource(str(root), a.size, seed=0, workers=a.workers)
        if loader is not None:
            src.sets["train"].inner.loader = loader
        s, k = time_source(src, batches, figs.device, sync)
        figs.record(figure, f"PIL decode + RandomResizedCrop, {a.workers} workers", s, k, a.workers)
        del src
    for figure, folder in (("shards-cpu", "s256"), ("full-cpu", "full")):
        src = ShardSource(str(Path(tmp) / folder), a.size, seed=0, workers=a.workers, decode="cpu")
        s, k = time_source(src, batches, figs.device, sync)
        figs.record(figure, f"libjpeg-turbo decode + crop in {a.workers} workers, {folder}", s, k, a.workers)


def time_gpu_paths(a: argparse.Namespace, tmp: str, batches: list[np.ndarray], n: int, sync,
                   figs: Figures) -> None:
    """The figures of the GPU decode paths: shards-gpu, full-gpu, nvjpeg-only (of ``n`` images)."""
    from rayconv.data import decode as dec  # (kept out of --help's path, as torch is)
    from rayconv.data.shards import ShardSource

    device = figs.device
    for figure, folder in (("shards-gpu", "s256"), ("full-gpu", "full")):
        src = ShardSource(str(Path(tmp) / folder), a.size, seed=0, workers=0, decode="gpu")
        s, k = time_source(src, batches, device, sync)
        figs.record(figure, f"nvJPEG batched decode + crop on the GPU, {folder}", s, k)
    src = ShardSource(str(Path(tmp) / "s256"), a.size, seed=0, workers=0, decode="gpu")
    dec.decode(src.jpegs("train", batches[0]), device)
    sync()
    t0 = time.perf_counter()
    for b in batches[1:]:
        dec.decode(src.jpegs("train", b), device)
    sync()
    figs.record("nvjpeg-only", "batched nvJPEG decode alone, s256", time.perf_counter() - t0,
                n - len(batches[0]))


def write_tables(rows: list[dict], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), out / "input_bench.parquet")
    lines = ["| figure | images/s | what |", "| --- | ---: | --- |"]
    lines += [f"| {r['figure']} | {r['images_per_s']:.0f} | {r['what']} |" for r in rows]
    (out / "input_bench.md").write_text("\n".join(lines) + "\n")
    print(f"# wrote {out / 'input_bench.parquet'} and {out / 'input_bench.md'}")


def main(argv=None) -> int:
    a = parse_flags(argv)
    import torch

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    procs = os.cpu_count() or 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        root, files, kb = write_and_prepare(a, tmp, device, procs)
        n = len(files)
        order = np.random.default_rng(0).permutation(n)
        batches = [order[i:i + a.batch] for i in range(0, n, a.batch)]
        if len(batches) < 2:
            print("input_bench: error: --images must be at least 2 x --batch", file=sys.stderr)
            return 2
        figs = Figures(device, a.batch, kb)
        time_cpu_paths(a, root, tmp, batches, sync, figs)
        if cuda:
            time_gpu_paths(a, tmp, batches, n, sync, figs)
        else:
            print("# GPU figures (shards-gpu, full-gpu, nvjpeg-only) need --device cuda", flush=True)
    write_tables(figs.rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

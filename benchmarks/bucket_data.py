"""Issue 69's "Data from a bucket" target: shards read from an S3-compatible bucket on loopback through
rayconv's node cache (``--data-dir s3://...``) against the same shards on local disk, on CPU (the
defaults: raw 32-px shards, resnet18) or one GPU.

    python benchmarks/bucket_data.py --out benchmarks/results/bucket-data     # about 5-10 min on 2 cores
    python benchmarks/bucket_data.py --out benchmarks/results/bucket-data-gpu-jpeg --device cuda \
        --precision bf16 --format jpeg --model resnet50 --image-size 224 --images 4000 --batch 256 \
        --steps 40 --repeats 2                                                 # a few minutes on one H100

In one run, one Ray cluster started here (after the S3 server, so every worker has its client
environment; on CPU 2 CPUs, on a GPU the machine's CPUs and GPUs): moto's S3 server
(``moto.server.ThreadedMotoServer``) on a free loopback port; the set, put in the bucket
(``pyarrow.fs.copy_files``):

* ``--format raw`` (default): ``benchmarks/make_raw_shards.py`` writes ``--images`` generated
  ``--image-size`` x ``--image-size`` images (default 32) in shards of ``--shard-size`` (default 2000);
* ``--format jpeg``: ``benchmarks/make_images.py`` writes about ``--images`` procedural JPEGs (100
  classes, 10 under 1000 images) whose shorter side is ``--image-size`` x 8/7 (256 for 224, 4:3), and
  ``rayconv.data.shard_writer.prepare`` re-encodes them into JPEG shards of ``--shard-size`` (default 500) at
  that shorter side, as ``python -m rayconv.prepare`` does; the runs decode them on the CPU
  (``--loader-workers`` default) and take ``--image-size`` crops (resized-crop above 64 px).

Figures:

* fill: the cache filled from the bucket (``rayconv.data.cache.ShardCache.ready``: fetch, size and
  sha256 checks, renames) against ``pyarrow.fs.copy_files`` of the same bytes from the same server into
  a local folder (the server's own rate), MB/s each and their ratio;
* images/s: ``--repeats`` pairs of training runs, interleaved ABBA (``--model``, default resnet18,
  ``--batch`` global, ``--steps`` steps, dp1 on ``--device`` at ``--precision``, ``--compile`` (default
  off), ``--data-on-device off``: streamed from the shards), one reading the local
  folder, one the bucket through the warm cache; each run's summary.json ``images_per_s``; the ratio
  of the medians (target >= 0.95) and each pair's (after one uncounted local run: Ray's first workers);
* cold cache: a run with an empty cache: its first step's time from the command's start (summary.json
  ``startup.phases.first_step``) less the warm run's, against the time ``copy_files`` takes for the
  shards the first ``READ_AHEAD`` batches read (``raw_shards.READ_AHEAD``; under the exact order every
  batch reads from every shard: the window is the whole set);
* streamed (with ``--cache-bytes N``, a budget smaller than the set): a pair of runs under ``--shuffle
  block --shuffle-window`` ``--window``, one reading the local folder, one the bucket streamed through a
  cache of N bytes (``rayconv.data.shard_stream``; a new cache folder: cold), images/s each and their
  ratio, and the largest bytes the cache held at the run's end.

Writes ``report.md`` and ``rows.json`` into ``--out``, and one line per figure on stdout (the
generators' own lines go to stderr).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


JPEG_CLASSES = 100   # --format jpeg: classes of the generated set (10 under 1000 images)


def jpeg_set(out: Path, images: int, size: int, shard_size: int) -> None:
    """Write about ``images`` procedural JPEG training images (``make_images.py``: shorter side ``size``
    x 8/7, 4:3, one val image a class) into a temporary folder, and their JPEG shards into ``out``
    (``shard_writer.prepare``: shorter side kept, quality 90, shards of ``shard_size``), with this
    machine's CPUs."""
    import make_images
    from rayconv.data.shard_writer import prepare

    classes = JPEG_CLASSES if images >= 1000 else 10
    side = math.ceil(size * 8 / 7)
    src = out.parent / (out.name + "-images")
    with contextlib.redirect_stdout(sys.stderr):
        make_images.main([str(src), "--classes", str(classes), "--train-per-class",
                          str(max(1, images // classes)), "--val-per-class", "1", "--width",
                          str(side * 4 // 3), "--height", str(side)])
    prepare(str(src), str(out), side, 90, shard_size, log=lambda *_: None, processes=os.cpu_count() or 1,
            encoding="jpeg")
    shutil.rmtree(src, ignore_errors=True)


def main(argv=None) -> int:
    from rayconv.flags import OneLineParser

    p = OneLineParser(prog="python benchmarks/bucket_data.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder of report.md and rows.json")
    p.add_argument("--images", type=int, default=20000, help="train images (default %(default)s)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="images a shard (default 2000 raw, 500 jpeg)")
    p.add_argument("--format", choices=("raw", "jpeg"), default="raw",
                   help="raw-pixel shards (default) or JPEG shards decoded on the CPU")
    p.add_argument("--image-size", type=int, default=None,
                   help="training image side in pixels (default 32 raw, 224 jpeg)")
    p.add_argument("--model", default="resnet18", help="model (default %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="(default %(default)s)")
    p.add_argument("--compile", choices=("on", "off"), default="off",
                   help="torch.compile (default off: its time would be in every run's first step)")
    p.add_argument("--steps", type=int, default=40, help="steps a training run (default %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="global batch size (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="pairs of local, bucket runs (default %(default)s)")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="also a streamed pair of runs through a cache of this many bytes (below the set's)")
    p.add_argument("--window", type=int, default=2, help="--shuffle-window of the streamed pair (default "
                   "%(default)s)")
    a = p.parse_args(argv)
    if a.shard_size is None:
        a.shard_size = 2000 if a.format == "raw" else 500
    if a.image_size is None:
        a.image_size = 32 if a.format == "raw" else 224
    for flag, v in (("--images", a.images), ("--shard-size", a.shard_size), ("--steps", a.steps),
                    ("--batch", a.batch), ("--repeats", a.repeats), ("--image-size", a.image_size)):
        if v < 1:
            p.error(f"{flag} must be at least 1 (got {v})")
    from rayconv.config import Config, ConfigError

    try:   # (a model, size or precision the runs would refuse: refused here, before the set is written)
        Config(model=a.model, data="shards", data_dir="s3://bucket/set", image_size=a.image_size, dp=1,
               global_batch_size=a.batch, steps=a.steps, device=a.device, precision=a.precision,
               data_on_device="off", compile=a.compile).validate()
        import torchvision

        from rayconv.model_names import RAYCONV_MODELS, unknown_model
        names = [*RAYCONV_MODELS, *torchvision.models.list_models(module=torchvision.models)]
        if ":" not in a.model and a.model not in names:
            raise unknown_model(a.model, names)
    except ConfigError as e:
        p.error(str(e))

    import logging

    import pyarrow.fs as pafs
    import ray

    logging.getLogger("werkzeug").setLevel(logging.ERROR)   # (the S3 server's request lines)

    from make_raw_shards import generate
    from rayconv.data import cache
    from rayconv.data.raw_shards import READ_AHEAD
    from rayconv.data.registry import first_epoch_order
    from rayconv.driver.job import train_run
    from tests.support.s3_server import s3_server

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bucket-data-"))
    rows: dict = {"args": vars(a)}
    try:
        with s3_server() as s3:
            local = work / a.format
            if a.format == "raw":
                generate(str(local), a.images, a.image_size, 10, 1000, a.shard_size,
                         processes=2 if a.device == "cpu" else None, log=lambda *_: None)
            else:
                jpeg_set(local, a.images, a.image_size, a.shard_size)
            train_images = json.loads((local / "manifest.json").read_text())["splits"]["train"]["images"]
            fs, set_bytes = s3.filesystem(), _bytes(local)
            uri = s3.uri(a.format)
            pafs.copy_files(str(local), f"{s3.bucket}/{a.format}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
            # fill: pyarrow's copy of the bytes (the server's rate), then rayconv's cache, into new folders
            (work / "copy").mkdir()
            t = time.perf_counter()
            pafs.copy_files(f"{s3.bucket}/{a.format}", str(work / "copy"), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
            copy_s = time.perf_counter() - t
            warm_dir = work / "cache-warm"
            t = time.perf_counter()
            cache.ShardCache(uri, str(warm_dir)).ready()
            fill_s = time.perf_counter() - t
            cache.release()
            rows["fill"] = {"bytes": set_bytes, "copy_files_s": copy_s, "cache_fill_s": fill_s,
                            "copy_files_MBps": set_bytes / copy_s / 1e6,
                            "cache_MBps": set_bytes / fill_s / 1e6,
                            "ratio": copy_s / fill_s}

            def cfg(data_dir, name: str, cache_dir: Path, **kw) -> Config:
                return Config(model=a.model, data="shards", data_dir=str(data_dir), image_size=a.image_size,
                              dp=1, global_batch_size=a.batch, steps=a.steps, lr=0.1, momentum=0.9,
                              device=a.device, precision=a.precision, data_on_device="off", progress=False,
                              eval_every=10**6, compile=a.compile,
                              out=str(work / "runs" / name), cache_dir=str(cache_dir), **kw).validate()

            ray.init(num_cpus=2 if a.device == "cpu" else None, include_dashboard=False, namespace="rayconv",
                     log_to_driver=False,
                     configure_logging=True, logging_level="WARNING")
            train_run(cfg(local, "warm-up", warm_dir), log=lambda *_: None)   # (uncounted: new workers)
            runs: dict[str, list] = {"local": [], "bucket": []}
            for r in range(a.repeats):
                pair = (("local", local), ("bucket", uri))
                for kind, where in (pair if r % 2 == 0 else pair[::-1]):   # (ABBA: drift cancels)
                    s = train_run(cfg(where, f"{kind}-{r}", warm_dir), log=lambda *_: None)
                    runs[kind].append({"images_per_s": s["images_per_s"],
                                       "first_step_s": s["startup"]["phases"]["first_step"]})
                    cache.release()
            rows["runs"] = runs
            med = {k: statistics.median(x["images_per_s"] for x in v) for k, v in runs.items()}
            pairs = [b["images_per_s"] / l["images_per_s"] for l, b in zip(runs["local"], runs["bucket"])]
            rows["images_per_s"] = {**med, "ratio": med["bucket"] / med["local"], "pair_ratios": pairs}
            # cold: an empty cache; the first read-ahead window's shards copied alone for the reference
            c = cfg(uri, "cold", work / "cache-cold")
            s = train_run(c, log=lambda *_: None)
            cache.release()
            manifest = json.loads((local / "manifest.json").read_text())
            order = first_epoch_order(c, manifest)[:READ_AHEAD * a.batch]
            window = cache.shard_order(manifest, order)
            window = [f for f in window if f.startswith("train-")]
            (work / "window").mkdir()
            t = time.perf_counter()
            for f in window:
                pafs.copy_files(f"{s3.bucket}/{a.format}/{f}", str(work / "window" / f), source_filesystem=fs,
                                destination_filesystem=pafs.LocalFileSystem())
            window_s = time.perf_counter() - t
            warm_first = statistics.median(x["first_step_s"] for x in runs["bucket"])
            cold_first = s["startup"]["phases"]["first_step"]
            rows["cold"] = {"first_step_s": cold_first, "warm_first_step_s": warm_first,
                            "added_s": cold_first - warm_first, "window_shards": len(window),
                            "train_shards": len(manifest["splits"]["train"]["shards"]),
                            "window_copy_files_s": window_s}
            if a.cache_bytes is not None:   # streamed: a cache smaller than the set, --shuffle block
                block = dict(shuffle="block", shuffle_window=a.window)
                streamed = {}
                budget = {"cache_bytes": a.cache_bytes}
                for kind, where, kw in (("local", local, {}), ("bucket", uri, budget)):
                    s = train_run(cfg(where, f"{kind}-block", work / "cache-stream", **block, **kw),
                                  log=lambda *_: None)
                    streamed[kind] = s["images_per_s"]
                held = sum(p.stat().st_size for p in (work / "cache-stream").glob("*/*") if p.is_file())
                rows["streamed"] = {**streamed, "ratio": streamed["bucket"] / streamed["local"],
                                    "cache_bytes": a.cache_bytes, "held_at_end": held, "set_bytes": set_bytes}
            ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=2) + "\n")
    f, i, c = rows["fill"], rows["images_per_s"], rows["cold"]
    kind = "raw pixels" if a.format == "raw" else "JPEG"
    report = "\n".join([
        f"# Data from a bucket: {a.model}, {a.device}, {a.precision}, batch {a.batch}, {a.steps} steps; "
        f"{train_images} train images ({kind}, {a.image_size} px), {f['bytes'] / 1e6:.1f} MB, shards of "
        f"{a.shard_size}", "",
        "| figure | value |", "| --- | --- |",
        f"| images/s, local shards (median of {a.repeats}) | {i['local']:.1f} |",
        f"| images/s, bucket, warm cache (median of {a.repeats}) | {i['bucket']:.1f} |",
        f"| ratio bucket / local (target >= 0.95) | {i['ratio']:.3f} (per pair: "
        f"{', '.join(f'{x:.2f}' for x in i['pair_ratios'])}) |",
        f"| cache fill | {f['cache_fill_s']:.2f} s, {f['cache_MBps']:.0f} MB/s |",
        f"| pyarrow.fs.copy_files, same bytes | {f['copy_files_s']:.2f} s, {f['copy_files_MBps']:.0f} MB/s |",
        f"| fill rate / copy_files rate | {f['ratio']:.2f} |",
        f"| cold cache: first step at | {c['first_step_s']:.1f} s (warm: {c['warm_first_step_s']:.1f} s; "
        f"added {c['added_s']:.1f} s) |",
        f"| first read-ahead window ({c['window_shards']} of {c['train_shards']} train shards), copy_files | "
        f"{c['window_copy_files_s']:.2f} s |", ""])
    lines = [
        f"fill: cache {f['cache_MBps']:.0f} MB/s, copy_files {f['copy_files_MBps']:.0f} MB/s "
        f"({f['bytes'] / 1e6:.1f} MB): ratio {f['ratio']:.2f}",
        f"warm cache: images/s bucket {i['bucket']:.1f} / local {i['local']:.1f} (medians of {a.repeats}): "
        f"ratio {i['ratio']:.3f} (target >= 0.95; pairs {', '.join(f'{x:.2f}' for x in i['pair_ratios'])})",
        f"cold cache: first step at {c['first_step_s']:.1f} s (warm {c['warm_first_step_s']:.1f} s: added "
        f"{c['added_s']:.1f} s); copy_files of the first read-ahead window "
        f"({c['window_shards']} of {c['train_shards']} shards) {c['window_copy_files_s']:.2f} s"]
    if "streamed" in rows:
        st = rows["streamed"]
        report += "\n".join([
            f"| streamed, --shuffle block --shuffle-window {a.window}: images/s local / bucket through "
            f"--cache-bytes {st['cache_bytes']} (set {st['set_bytes']} B) | {st['local']:.1f} / "
            f"{st['bucket']:.1f} (ratio {st['ratio']:.3f}; cache held {st['held_at_end']} B at the end) |",
            ""])
        lines.append(f"streamed: images/s bucket {st['bucket']:.1f} / local {st['local']:.1f}: ratio "
                     f"{st['ratio']:.3f}; cache held {st['held_at_end']} of {st['cache_bytes']} B")
    (out / "report.md").write_text(report)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An ImageNet-layout folder -> Arrow IPC shards of JPEGs re-encoded at training size, or of raw
pixels (``encoding="raw"``: uint8 size x size x 3, ``encode_raw``; ``resolve_encoding`` says when
``auto`` picks which), what ``python -m rayconv.prepare`` runs, so that training decodes small baseline
JPEGs, or reads pixels without decoding, from a few large files.

The shorter side of each image is resized to ``size`` (smaller images are kept at their size, never
enlarged), as FFCV and fast ImageNet recipes store ImageNet, and re-encoded at ``quality``. Every
``shard_size`` files of a split make one shard (``write_shard``, one call per shard, fanned out by the
caller: Ray tasks for the command line, local processes otherwise). The train split's files go into
its shards in a seeded permutation of the sorted listing (``shard_order="shuffled"``, ``shard_files``
says which), so that every shard holds a sample of all classes and ``--shuffle block`` windows of a
few shards are not class-homogeneous (the advice of webdataset and MosaicML streaming: shuffle
before sharding); ``shard_order="sorted"`` keeps the listing's order; val is always in listing
order. Each shard is written into ``<name>.tmp`` and
fsynced and renamed when complete; a write that fails (a full disk: ENOSPC, EFBIG) removes its
``.tmp``, so no half shard is left to be taken as complete. A re-run skips the shards already complete
(same settings, shard order and seed included, same input files in the same order, same sha256 as
the manifest says), so an interrupted run resumes. ``manifest.json`` is written last
(atomically): classes, images per split and class, the files skipped and why, each shard's rows, bytes
and sha256, the format version and the settings. The shard format is described in
``rayconv/data/shard_files.py``; ``shard_convert.py`` rewrites a folder of the older Parquet format.

Bad input (``rayconv/data/folders.py``: what a folder holds): CMYK, grayscale, palette and RGBA
images, PNG, WebP and the other formats Pillow reads are converted to RGB. A file that does not decode
(corrupt, truncated), one without an image suffix, one that cannot be read (a dangling link) and a
directory named like an image are skipped and counted: a warning names the count and the first few,
the manifest lists them all.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from rayconv.data.folders import SPLITS, scan
from rayconv.data.shard_files import MANIFEST, SUFFIX
from rayconv.data.shard_table import SHARD_META, make_manifest, shard_entry, write_manifest, write_rows
from rayconv.errors import DataError
from rayconv.files import sha256_file


# args of each shard's write_shard call, by shard name -> (shard name, its manifest entry) as each finishes
FanOut = Callable[[dict[str, tuple]], Iterator[tuple[str, dict[str, Any]]]]


def encode(path: Path, size: int, quality: int) -> tuple[bytes, int, int]:
    """One image file -> (baseline RGB JPEG bytes, height, width), shorter side resized to ``size``
    (never enlarged). JPEGs are decoded at a reduced DCT scale first when much larger (Pillow's draft).
    Raises OSError / ValueError (Pillow's) for a file that cannot be read or decoded."""
    from PIL import Image   # (only where images are encoded: keeps Pillow out of the command line's start)

    with Image.open(path) as img:
        w, h = img.size
        scale = min(1.0, size / min(w, h))
        tw, th = max(1, round(w * scale)), max(1, round(h * scale))
        if img.format == "JPEG" and scale < 1:
            img.draft("RGB", (tw, th))   # DCT-domain downscale by 1/2, 1/4 or 1/8, never below (tw, th)
        img.load()
        rgb = img.convert("RGB")
    if rgb.size != (tw, th):
        rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC, reducing_gap=None)
    buf = io.BytesIO()
    rgb.save(buf, "JPEG", quality=quality)
    return buf.getvalue(), th, tw


def encode_raw(path: Path, size: int) -> bytes:
    """One image file -> its ``size`` x ``size`` RGB pixels as uint8 bytes (H x W x 3, row-major): the
    shorter side resized to ``size`` as ``encode`` does (bicubic; smaller images are enlarged, so that
    every row has one shape), then the center ``size`` x ``size`` crop (``raw_pixels``). Raises OSError
    / ValueError (Pillow's) for a file that cannot be read or decoded."""
    from PIL import Image

    with Image.open(path) as img:
        w, h = img.size
        scale = size / min(w, h)
        if img.format == "JPEG" and scale < 1:
            img.draft("RGB", (max(size, round(w * scale)), max(size, round(h * scale))))
        img.load()
        return raw_pixels(img.convert("RGB"), size)


def raw_pixels(rgb, size: int) -> bytes:
    """A PIL RGB image -> ``size`` x ``size`` x 3 uint8 bytes: shorter side resized to ``size``
    (bicubic, up or down; the longer side rounded as ``encode`` rounds it), then the center crop (top
    and left offsets rounded down)."""
    from PIL import Image

    w, h = rgb.size
    scale = size / min(w, h)
    tw, th = max(size, round(w * scale)), max(size, round(h * scale))
    if rgb.size != (tw, th):
        rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC, reducing_gap=None)
    left, top = (tw - size) // 2, (th - size) // 2
    return rgb.crop((left, top, left + size, top + size)).tobytes()


ENCODINGS = ("auto", "raw", "jpeg")
RAW_MAX_SIZE = 64   # --encoding auto: raw pixels up to this --size, JPEG above


def resolve_encoding(encoding: str, size: int) -> str:
    """``--encoding``: ``raw`` or ``jpeg`` as given; ``auto`` is raw when ``size`` <= ``RAW_MAX_SIZE``.
    The rule's reason: raw pixels need no decode, and at 64 px an image is 12 KB, a few times its JPEG,
    so reading it costs less than decoding a JPEG (whose decode takes more CPU per image than reading
    its raw bytes from the page cache); raw bytes grow as size squared (147 KiB an image at 224 px),
    where disk and page cache, not decode, would set the rate. Raises ValueError for another ``encoding``."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r} is not one of {ENCODINGS}")
    return ("raw" if size <= RAW_MAX_SIZE else "jpeg") if encoding == "auto" else encoding


SHARD_ORDERS = ("shuffled", "sorted")


def shard_listing(listing: list[tuple[str, int]], order: str, seed: int) -> list[tuple[int, str, int]]:
    """The files of a split as (index, relative path, label) in the order they go into its shards:
    ``index`` is the file's position in the sorted ``listing``. ``sorted``: the listing's order.
    ``shuffled``: ordered by sha256 of (seed, relative path), a seeded permutation that is the same on
    every machine and numpy version (same command, same bytes). Raises ValueError for another ``order``."""
    if order not in SHARD_ORDERS:
        raise ValueError(f"shard order {order!r} is not one of {SHARD_ORDERS}")
    indexed = [(i, rel, label) for i, (rel, label) in enumerate(listing)]
    if order == "sorted":
        return indexed
    key = lambda e: hashlib.sha256(f"{seed}\0{e[1]}".encode()).digest()  # noqa: E731
    return sorted(indexed, key=key)


def _with_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """Recorded settings with the keys folders written before ``shard_order`` existed lack: those were
    written in sorted order (so ``--shard-order sorted`` resumes them), and before ``encoding``: JPEGs."""
    return {"shard_order": "sorted", "seed": None, "encoding": "jpeg", **settings}


def _meta(settings: dict[str, Any], inputs: list[tuple[int, str, int]]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()
    return {"settings": settings, "inputs_sha256": digest}


def _complete(final: Path, meta: dict[str, Any], expect_sha256: Optional[str]) -> Optional[dict[str, Any]]:
    """The result of a complete shard ``final`` of these inputs and settings already there, else None."""
    import pyarrow as pa

    if not final.is_file():
        return None
    try:
        with pa.memory_map(str(final)) as f:
            done = json.loads((pa.ipc.open_file(f).schema.metadata or {})[SHARD_META])
        done["settings"] = _with_defaults(done["settings"])
        sha = sha256_file(final)
        if {k: done[k] for k in meta} == meta and expect_sha256 in (None, sha):
            return {**shard_entry(final, done["rows"], sha), "skipped": done["skipped"],
                    "counts": done["counts"], "resumed": True}
    except (OSError, KeyError, ValueError, pa.ArrowException):
        pass  # not a complete shard of these inputs: write it again
    return None


def write_shard(root: str, out: str, name: str, inputs: list[tuple[int, str, int]], settings: dict[str, Any],
                expect_sha256: Optional[str]) -> dict[str, Any]:
    """Write shard ``name`` of ``inputs`` (index, relative path, label) unless a complete one is there
    (same settings and inputs, and ``expect_sha256`` when the manifest knew it). Returns its manifest
    entry plus ``skipped`` files, per-label ``counts`` and ``seconds`` (this call's own time). Runs in a
    Ray task or a pool process. Raises OSError (e.g. the disk is full) with no ``.tmp`` left behind."""
    t0 = time.perf_counter()
    final, meta = Path(out) / name, _meta(settings, inputs)
    resumed = _complete(final, meta, expect_sha256)
    if resumed is not None:
        return {**resumed, "seconds": time.perf_counter() - t0}
    raw, size = settings.get("encoding") == "raw", settings["size"]
    column = "pixels" if raw else "jpeg"
    rows: dict[str, list] = {"index": [], "label": [], "height": [], "width": [], column: [], "path": []}
    skipped = []
    for index, rel, label in inputs:
        try:
            if raw:
                data, h, w = encode_raw(Path(root) / rel, size), size, size
            else:
                data, h, w = encode(Path(root) / rel, size, settings["quality"])
        # (Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...)
        except Exception as e:  # noqa: BLE001 - any decoding failure skips the file
            skipped.append({"path": rel, "reason": f"cannot read or decode ({type(e).__name__}: {e})"})
            continue
        for k, v in zip(rows, (index, label, h, w, data, rel)):
            rows[k].append(v)
    return {**write_rows(final, rows, meta, skipped, size if raw else None),
            "seconds": time.perf_counter() - t0}


def _ours(name: str) -> bool:
    """Whether ``name`` is a file prepare writes: a shard, the manifest, or either's ``.tmp``."""
    return re.fullmatch(r"(train|val)-\d{5}\.(arrow|parquet)(\.tmp)?|manifest\.json(\.tmp)?",
                        name) is not None


def on_processes(args: dict[str, tuple], processes: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each shard's ``write_shard`` on a local pool of ``processes`` processes (no Ray:
    benchmarks/input_bench.py); yields (name, entry) as they finish. In a process connected to Ray (a
    driver calling ``prepare`` between runs) or one that has used CUDA, the pool's processes start from
    a fork server: a fork of this process would copy Ray's gRPC threads' state mid-use, and CUDA cannot
    be used in a forked child. One process: the shards are written here, in turn (a pool of one would
    only add its start, seconds from a fork server, whose process imports the writer afresh)."""
    if processes <= 1:
        for name, a in args.items():
            yield name, write_shard(*a)
        return
    connected = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    cuda = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    context = multiprocessing.get_context("forkserver") if connected or cuda else None
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        futures = {pool.submit(write_shard, *a): name for name, a in args.items()}
        for f in as_completed(futures):
            yield futures[f], f.result()


def _previous_shards(dest: Path, settings: dict[str, Any]) -> dict[str, str]:
    """{shard file: sha256} of the manifest already in ``dest`` (empty without one). Raises DataError for
    a manifest that cannot be read, one of other settings, or a ``dest`` holding files prepare did not
    write."""
    old: dict[str, str] = {}
    if (dest / MANIFEST).is_file():
        try:
            manifest = json.loads((dest / MANIFEST).read_text())
            prev = _with_defaults(manifest["settings"])
            old = {e["file"]: e["sha256"] for s in manifest["splits"].values() for e in s["shards"]}
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{dest / MANIFEST} cannot be read ({e}): remove it or choose another --out") from None
        if prev != settings:
            raise DataError(
                f"{dest} was prepared with {prev}, not {settings}: use the same settings or another --out")
    others = sorted(p.name for p in dest.iterdir() if not _ours(p.name)) if dest.is_dir() else []
    if others:
        raise DataError(
            f"--out {dest} holds files prepare did not write ({', '.join(others[:3])}): choose a new "
            "or empty folder")
    return old


def split_summary(split: str, entries: list[dict[str, Any]], classes: list[str],
                  skipped: list[dict[str, str]], listed: int, dest: Path, log) -> dict[str, Any]:
    """The manifest's entry for one split; logs one warning line when files were skipped."""
    per_class = {c: sum(e["counts"].get(str(i), 0) for e in entries) for i, c in enumerate(classes)}
    bad = skipped + [x for e in entries for x in e["skipped"]]
    if bad:
        names = ", ".join(f"{b['path']} ({b['reason']})" for b in bad[:3])
        log(f"prepare: warning: skipped {len(bad)} of {listed + len(skipped)} {split} entries "
            f"(first: {names}); all are listed in {dest / MANIFEST}")
    return {"images": sum(e["rows"] for e in entries), "per_class": per_class, "skipped": bad,
            "shards": [{k: e[k] for k in ("file", "rows", "bytes", "sha256")} for e in entries]}


def _fan_out(args: dict[str, tuple], run: FanOut) -> dict[str, dict[str, Any]]:
    """Run every shard's ``write_shard`` through ``run`` under a progress bar over images (rate and time
    left; on a terminal only); returns the results by shard name."""
    from tqdm import tqdm   # (only while preparing: keeps tqdm out of the command line's start)

    results: dict[str, dict[str, Any]] = {}
    total = sum(len(a[3]) for a in args.values())
    with tqdm(total=total, desc="prepare", unit="img", smoothing=0.1, disable=not sys.stderr.isatty()) as bar:
        for name, result in run(args):
            results[name] = result
            bar.update(len(args[name][3]))
    return results


def _rate_line(results: dict[str, dict[str, Any]], inputs: dict[str, int], wall_s: float) -> str:
    """Images encoded (the files that were, not those given: a file that does not decode is named as
    skipped), and images/s per core: over the summed time of the shard calls that wrote (each call runs
    on one core), so that it does not depend on how many cores the fan-out had."""
    written = [n for n, r in results.items() if not r["resumed"]]
    if not sum(inputs[n] for n in written):
        return "nothing to encode"
    images, core_s = sum(results[n]["rows"] for n in written), sum(results[n]["seconds"] for n in written)
    bad = [x["path"] for n in written for x in results[n]["skipped"]]
    not_encoded = (f" ({len(bad)} not: {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''} did not decode)"
                   if bad else "")
    return (
        f"{images} images encoded{not_encoded} in {wall_s:.1f} s: {images / max(core_s, 1e-9):.0f} images/s "
        f"per core ({core_s:.1f} core-seconds), {images / max(wall_s, 1e-9):.0f} images/s in all")


def _jobs(files: dict[str, list[tuple[str, int]]], shard_size: int, shard_order: str,
          seed: int) -> list[tuple[str, str, list[tuple[int, str, int]]]]:
    """(split, shard name, its inputs) of every shard: train in ``shard_order``, val sorted."""
    jobs = []
    for split, listing in files.items():
        ordered = shard_listing(listing, shard_order if split == SPLITS["train"] else "sorted", seed)
        for k, start in enumerate(range(0, len(ordered), shard_size)):
            jobs.append((split, f"{split}-{k:05d}{SUFFIX}", ordered[start:start + shard_size]))
    return jobs


def prepare(src: str, out: str, size: int = 256, quality: int = 90, shard_size: int = 1000, log=print,
            processes: Optional[int] = None, fan_out: Optional[FanOut] = None, shard_order: str = "shuffled",
            seed: int = 0, encoding: str = "jpeg") -> dict[str, Any]:
    """Prepare ``src`` into ``out``; returns the manifest. The shards are written by ``fan_out`` (the
    command line passes Ray tasks), else by ``processes`` local processes (default: this machine's CPU
    count); the train files in ``shard_order`` (``shard_listing``; ``seed`` is recorded as None for
    sorted, which uses none) and ``encoding`` (``resolve_encoding``: raw pixels, format 3, or JPEGs at
    ``quality``, format 2). The last log line names the images encoded and images/s per core. Raises
    DataError for bad input (nothing is written then) or an ``out`` prepared with other settings;
    ValueError for an unknown ``shard_order`` or ``encoding``; OSError (a full disk) with no half-written
    shard or manifest left."""
    t0 = time.perf_counter()
    root, dest = Path(src).resolve(), Path(out)
    if shard_order not in SHARD_ORDERS:
        raise ValueError(f"shard order {shard_order!r} is not one of {SHARD_ORDERS}")
    encoding = resolve_encoding(encoding, size)
    settings = {"size": size, "quality": quality if encoding == "jpeg" else None, "shard_size": shard_size,
                "shard_order": shard_order, "seed": seed if shard_order == "shuffled" else None,
                "encoding": encoding}
    classes, files, skipped = scan(root)
    old = _previous_shards(dest, settings)
    dest.mkdir(parents=True, exist_ok=True)
    # A folder with a manifest is complete: it goes until the new one is written (shards already
    # complete are kept and checked against the old manifest's sha256).
    (dest / MANIFEST).unlink(missing_ok=True)
    for tmp in dest.glob("*.tmp"):
        tmp.unlink()   # left by an interrupted run
    jobs = _jobs(files, shard_size, shard_order, seed)
    args = {name: (str(root), str(dest), name, inputs, settings, old.get(name)) for _, name, inputs in jobs}
    results = _fan_out(args, fan_out or (lambda a: on_processes(a, processes or os.cpu_count() or 1)))
    wanted = {name for _, name, _ in jobs}
    for stale in dest.iterdir():
        if _ours(stale.name) and stale.name != MANIFEST and stale.name not in wanted:
            stale.unlink()   # a shard of files no longer in the source folder, or of the older format
    splits = {
        split: split_summary(
            split,
            [results[n] for s, n, _ in jobs if s == split],
            classes,
            skipped[split],
            len(files[split]),
            dest,
            log,
        )
        for split in SPLITS.values()
    }
    manifest = make_manifest(str(root), settings, classes, splits)
    write_manifest(dest, manifest)
    resumed = sum(1 for r in results.values() if r["resumed"])
    log(f"prepare: {splits['train']['images']} train and {splits['val']['images']} val images "
        f"({'raw pixels, ' + str(size) + 'x' + str(size) if encoding == 'raw' else 'JPEG'}) in {len(jobs)} "
        f"shards ({resumed} already complete) -> {dest}")
    log("prepare: " + _rate_line(results, {n: len(i) for _, n, i in jobs}, time.perf_counter() - t0))
    return manifest

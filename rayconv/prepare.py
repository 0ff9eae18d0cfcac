"""``python -m rayconv.prepare DIR --out SHARDS``: an ImageNet-layout folder -> Parquet shards of JPEGs
re-encoded at training size, so that training decodes small baseline JPEGs from a few large files.

The shorter side of each image is resized to ``--size`` (default 256; smaller images are kept at their
size, never enlarged), as FFCV and fast ImageNet recipes store ImageNet, and re-encoded at
``--quality``. Every ``--shard-size`` files of a split make one shard, written by one Ray task on the
cluster (``--address``, RAY_ADDRESS or a running cluster, else a local one), into ``<name>.tmp`` and
renamed when complete. A re-run skips the shards already complete (same settings, same input files,
same sha256 as the manifest says), so an interrupted run resumes. ``manifest.json`` is written last
(atomically): classes, images per split and class, the files skipped and why, each shard's rows, bytes
and sha256, and the settings. Training (``--data shards``) refuses a folder whose files do not match it.

Bad input: class folders are the sub-folders of ``DIR/train`` (names starting with "." are ignored);
``DIR/val`` must have the same ones, and each must hold at least one image file, else an error names the
folder. CMYK, grayscale, palette and RGBA images, PNG, WebP and the other formats Pillow reads are
converted to RGB. A file that does not decode (corrupt, truncated), one without an image suffix,
one that cannot be read (a dangling link) and a directory named like an image are skipped and
counted: a warning names the count and the first few, the manifest lists them all.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from rayconv.data.source import IMAGE_SUFFIXES, hidden
from rayconv.errors import DataError
from rayconv.data.shards import FORMAT, MANIFEST, SPLITS

SHARD_META = b"rayconv.shard"   # Parquet key-value metadata of a shard: its settings, inputs and skipped files


def scan(root: Path) -> tuple[list[str], dict[str, list[tuple[str, int]]], dict[str, list[dict[str, str]]]]:
    """(classes, {split: [(relative path, label)]}, {split: [skipped {path, reason}]}) of an ImageNet-
    layout folder, files in sorted order. Raises DataError for a missing split, no classes, val classes
    other than train's, or a class folder without image files."""
    def class_dirs(split_dir: Path) -> list[str]:
        if not split_dir.is_dir():
            raise DataError(f"{split_dir} does not exist: DIR must hold train/<class>/*.JPEG and val/<class>/...")
        return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not hidden(p.name))

    classes = class_dirs(root / "train")
    if not classes:
        raise DataError(f"{root / 'train'} has no class folders: put images in {root}/train/<class>/")
    files: dict[str, list[tuple[str, int]]] = {}
    skipped: dict[str, list[dict[str, str]]] = {}
    for split in SPLITS.values():
        found = class_dirs(root / split)
        if found != classes:
            raise DataError(f"{root / split} has classes {found[:5]}... but train has {classes[:5]}...: "
                            "both need the same class folders")
        files[split], skipped[split] = [], []
        for label, name in enumerate(classes):
            images, bad = _walk(root / split / name, root)
            files[split] += [(rel, label) for rel in images]
            skipped[split] += bad
            if not images:
                raise DataError(f"class folder {root / split / name} has no image files "
                                f"({', '.join(IMAGE_SUFFIXES)}): add images or remove the folder")
    return classes, files, skipped


def _walk(folder: Path, root: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(image files, skipped entries {path, reason}) under ``folder`` (links followed, sorted), paths
    relative to ``root``: files with an image suffix; skipped: other files and directories named like
    an image. Hidden folders and files (names starting with a dot, ``data.hidden``) are not data: left
    out, neither images nor skipped, as ``--data imagefolder`` leaves them out."""
    images, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not hidden(d))
        rel = Path(dirpath).relative_to(root)
        skipped += [{"path": str(rel / d), "reason": "a directory, not an image file"}
                    for d in dirnames if Path(d).suffix.lower() in IMAGE_SUFFIXES]
        for f in sorted(f for f in filenames if not hidden(f)):
            if Path(f).suffix.lower() in IMAGE_SUFFIXES:
                images.append(str(rel / f))
            else:
                skipped.append({"path": str(rel / f), "reason": "not an image file (suffix)"})
    return images, skipped


def warn_skipped(split_dir: Path, log=None) -> int:
    """For ``--data imagefolder``: one warning line naming the count and the first few entries of
    ``split_dir``'s class folders that torchvision's ImageFolder leaves out (files without an image
    suffix, directories named like an image); returns the count."""
    skipped = [x for c in sorted(split_dir.iterdir()) if c.is_dir() and not hidden(c.name)
               for x in _walk(c, split_dir.parent)[1]]
    if skipped:
        names = ", ".join(f"{b['path']} ({b['reason']})" for b in skipped[:3])
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"rayconv: warning: {split_dir}: skipped {len(skipped)} entries that are not image files (first: {names})")
    return len(skipped)


def encode(path: Path, size: int, quality: int) -> tuple[bytes, int, int]:
    """One image file -> (baseline RGB JPEG bytes, height, width), shorter side resized to ``size``
    (never enlarged). JPEGs are decoded at a reduced DCT scale first when much larger (Pillow's draft).
    Raises OSError / ValueError (Pillow's) for a file that cannot be read or decoded."""
    from PIL import Image

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


def _meta(settings: dict[str, Any], inputs: list[tuple[int, str, int]]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()
    return {"settings": settings, "inputs_sha256": digest}


def write_shard(root: str, out: str, name: str, inputs: list[tuple[int, str, int]], settings: dict[str, Any],
                expect_sha256: Optional[str]) -> dict[str, Any]:
    """Write shard ``name`` of ``inputs`` (index, relative path, label) unless a complete one is there
    (same settings and inputs, and ``expect_sha256`` when the manifest knew it). Returns its manifest
    entry plus ``skipped`` files and per-label ``counts``. Runs as a Ray task."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayconv.files import sha256_file

    final, meta = Path(out) / name, _meta(settings, inputs)
    if final.is_file():
        try:
            kv = pq.read_schema(final).metadata or {}
            done = json.loads(kv[SHARD_META])
            sha = sha256_file(final)
            if {k: done[k] for k in meta} == meta and expect_sha256 in (None, sha):
                return {**_entry(final, done["rows"], sha), "skipped": done["skipped"], "counts": done["counts"],
                        "resumed": True}
        except (OSError, KeyError, ValueError, pa.ArrowException):
            pass  # not a complete shard of these inputs: write it again
    rows: dict[str, list] = {"index": [], "label": [], "height": [], "width": [], "jpeg": [], "path": []}
    skipped, counts = [], {}
    for index, rel, label in inputs:
        try:
            data, h, w = encode(Path(root) / rel, settings["size"], settings["quality"])
        except Exception as e:  # noqa: BLE001 - Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...
            skipped.append({"path": rel, "reason": f"cannot read or decode ({type(e).__name__}: {e})"})
            continue
        for k, v in zip(rows, (index, label, h, w, data, rel)):
            rows[k].append(v)
        counts[str(label)] = counts.get(str(label), 0) + 1
    schema = pa.schema([("index", pa.int64()), ("label", pa.int32()), ("height", pa.int32()),
                        ("width", pa.int32()), ("jpeg", pa.binary()), ("path", pa.string())])
    done = {**meta, "rows": len(rows["index"]), "skipped": skipped, "counts": counts}
    table = pa.table(rows, schema=schema).replace_schema_metadata({SHARD_META: json.dumps(done)})
    tmp = final.with_name(name + ".tmp")
    # JPEG bytes do not compress: stored plain, so reading them is a copy, not a decompression.
    pq.write_table(table, tmp, compression="none", use_dictionary=["label"], row_group_size=1024)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return {**_entry(final, done["rows"], sha256_file(final)), "skipped": skipped, "counts": counts, "resumed": False}


def _ours(name: str) -> bool:
    """Whether ``name`` is a file prepare writes: a shard, the manifest, or either's ``.tmp``."""
    return re.fullmatch(r"(train|val)-\d{5}\.parquet(\.tmp)?|manifest\.json(\.tmp)?", name) is not None


def _entry(path: Path, rows: int, sha: str) -> dict[str, Any]:
    return {"file": path.name, "rows": rows, "bytes": path.stat().st_size, "sha256": sha}


def _on_ray(args: dict[str, tuple], address: Optional[str]):
    """Each shard's ``write_shard`` as a Ray task; yields (name, entry) as they finish."""
    import ray

    from rayconv.cluster import group as cluster

    cluster.connect(address)
    task = ray.remote(num_cpus=1)(write_shard)
    refs = {task.remote(*a): name for name, a in args.items()}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            yield refs[ready[0]], ray.get(ready[0])
        except ray.exceptions.RayTaskError as e:   # e.g. the disk is full: the shard stays unwritten
            for ref in pending:
                ray.cancel(ref)
            cause = e.cause if e.cause is not None else e
            raise DataError(f"writing {args[refs[ready[0]]][1]}/{refs[ready[0]]} failed ({type(cause).__name__}: "
                            f"{cause}): fix that and run the same command again (complete shards are kept)") from None


def _on_processes(args: dict[str, tuple], processes: int):
    """The same on a local process pool (no Ray: benchmarks/input_bench.py)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(processes) as pool:
        futures = {pool.submit(write_shard, *a): name for name, a in args.items()}
        for f in as_completed(futures):
            yield futures[f], f.result()


def prepare(src: str, out: str, size: int = 256, quality: int = 90, shard_size: int = 1000,
            address: Optional[str] = None, log=print, processes: Optional[int] = None) -> dict[str, Any]:
    """Prepare ``src`` into ``out`` on the Ray cluster (or, with ``processes``, on that many local
    processes); returns the manifest. Raises DataError for bad input (nothing is written then) or an
    ``out`` prepared with other settings."""
    from tqdm import tqdm

    root, dest = Path(src).resolve(), Path(out)
    settings = {"size": size, "quality": quality, "shard_size": shard_size}
    classes, files, skipped = scan(root)
    old: dict[str, str] = {}
    if (dest / MANIFEST).is_file():
        try:
            manifest = json.loads((dest / MANIFEST).read_text())
            prev = manifest["settings"]
            old = {e["file"]: e["sha256"] for s in manifest["splits"].values() for e in s["shards"]}
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{dest / MANIFEST} cannot be read ({e}): remove it or choose another --out") from None
        if prev != settings:
            raise DataError(f"{dest} was prepared with {prev}, not {settings}: use the same settings or another --out")
    others = sorted(p.name for p in dest.iterdir() if not _ours(p.name)) if dest.is_dir() else []
    if others:
        raise DataError(f"--out {dest} holds files prepare did not write ({', '.join(others[:3])}): choose a new "
                        "or empty folder")
    dest.mkdir(parents=True, exist_ok=True)
    # A folder with a manifest is complete: it goes until the new one is written (shards already
    # complete are kept and checked against the old manifest's sha256).
    (dest / MANIFEST).unlink(missing_ok=True)
    for tmp in dest.glob("*.tmp"):
        tmp.unlink()   # left by an interrupted run
    jobs = []
    for split, listing in files.items():
        for k, start in enumerate(range(0, len(listing), shard_size)):
            inputs = [(start + i, rel, label) for i, (rel, label) in enumerate(listing[start:start + shard_size])]
            jobs.append((split, f"{split}-{k:05d}.parquet", inputs))
    args = {name: (str(root), str(dest), name, inputs, settings, old.get(name)) for _, name, inputs in jobs}
    results: dict[str, dict[str, Any]] = {}
    with tqdm(total=len(args), desc="prepare", unit="shard", disable=not sys.stderr.isatty()) as bar:
        for name, result in (_on_processes(args, processes) if processes else _on_ray(args, address)):
            results[name] = result
            bar.update(1)
    wanted = {name for _, name, _ in jobs}
    for stale in dest.glob("*.parquet"):
        if _ours(stale.name) and stale.name not in wanted:
            stale.unlink()   # a shard of files no longer in the source folder
    splits: dict[str, Any] = {}
    for split in SPLITS.values():
        entries = [results[name] for s, name, _ in jobs if s == split]
        per_class = {c: sum(e["counts"].get(str(i), 0) for e in entries) for i, c in enumerate(classes)}
        bad = skipped[split] + [x for e in entries for x in e["skipped"]]
        splits[split] = {"images": sum(e["rows"] for e in entries), "per_class": per_class,
                         "skipped": bad, "shards": [{k: e[k] for k in ("file", "rows", "bytes", "sha256")}
                                                    for e in entries]}
        if bad:
            names = ", ".join(f"{b['path']} ({b['reason']})" for b in bad[:3])
            log(f"prepare: warning: skipped {len(bad)} of {len(files[split]) + len(skipped[split])} {split} entries "
                f"(first: {names}); all are listed in {dest / MANIFEST}")
    manifest = {"format": FORMAT, "source": str(root), "settings": settings, "classes": classes, "splits": splits}
    tmp = dest / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, dest / MANIFEST)
    resumed = sum(1 for r in results.values() if r["resumed"])
    log(f"prepare: {splits['train']['images']} train and {splits['val']['images']} val images in {len(jobs)} "
        f"shards ({resumed} already complete) -> {dest}")
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    from rayconv.errors import ClusterError
    from rayconv.config import OneLineParser

    p = OneLineParser(prog="python -m rayconv.prepare",
                      description="Re-encode an ImageNet-layout folder (train/<class>/*, val/<class>/*) into "
                                  "Parquet shards of training-size JPEGs for --data shards, on the Ray cluster.")
    p.add_argument("dir", help="the image folder, holding train/ and val/")
    p.add_argument("--out", required=True, help="the folder to write the shards and manifest.json into")
    p.add_argument("--size", type=int, default=256, help="shorter side in pixels (default 256; never enlarged)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality 1-100 (default 90)")
    p.add_argument("--shard-size", type=int, default=1000, help="images per shard (default 1000)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, a running "
                                                   "cluster, else a new local one)")
    a = p.parse_args(argv)
    for flag, v, lo, hi in (("--size", a.size, 32, 1 << 16), ("--quality", a.quality, 1, 100),
                            ("--shard-size", a.shard_size, 1, 1 << 24)):
        if not lo <= v <= hi:
            print(f"rayconv.prepare: error: {flag} must be in [{lo}, {hi}] (got {v})", file=sys.stderr)
            return 2
    try:
        prepare(a.dir, a.out, a.size, a.quality, a.shard_size, a.address)
        return 0
    except DataError as e:
        print(f"rayconv.prepare: error: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"rayconv.prepare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rayconv.prepare: interrupted: complete shards are kept in {a.out}; run the same command again "
              "to finish", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""A prepared folder of the older format ``rayconv-shards/1`` (Parquet shards) rewritten in place as
format ``rayconv-shards/2`` (Arrow IPC shards, ``rayconv/data/shard_files.py``): what ``python -m
rayconv.prepare --convert DIR`` runs.

Each Parquet shard is checked against its manifest entry (bytes, sha256), then written as
``<name>.arrow`` atomically (``shard_table.write_atomic``: tmp, fsync, rename), with the same rows,
columns and schema metadata. The new manifest is written last (atomically), then the Parquet shards are
removed. Interrupted at any point, the folder is either still format 1 (the same command again
converts it) or complete in format 2.

``convert_encoding`` re-encodes a prepared folder (raw pixels <-> JPEG) into a new folder: each shard
read, checked against its sha256, re-encoded and written atomically in a process pool, the manifest
last; the source folder is not changed.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Optional

from rayconv.data.shard_files import FORMAT, FORMAT_PARQUET, FORMAT_RAW, MANIFEST, SUFFIX, read_manifest
from rayconv.data.shard_files import encoding as encoding_of
from rayconv.data.shard_table import SHARD_META, shard_schema, write_atomic, write_manifest
from rayconv.data.shard_writer import raw_pixels
from rayconv.errors import DataError
from rayconv.files import sha256_file


def _convert_shard(root: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """One Parquet shard -> its Arrow IPC twin; returns the new manifest entry. Raises DataError when the
    Parquet file does not match its entry."""
    import pyarrow.parquet as pq   # (pyarrow's import is slow: only where shards are converted)

    src = root / entry["file"]
    if not src.is_file() or src.stat().st_size != entry["bytes"] or sha256_file(src) != entry["sha256"]:
        raise DataError(f"{src} is missing or does not match {MANIFEST} (bytes, sha256): prepare the folder "
                        "again from its images instead")
    table = pq.read_table(src)
    meta = table.schema.metadata
    table = table.select(shard_schema().names).cast(shard_schema()).replace_schema_metadata(meta)
    if table.num_rows != entry["rows"]:
        raise DataError(
            f"{src} holds {table.num_rows} rows, {MANIFEST} says {entry['rows']}: prepare the folder again")
    final = root / (Path(entry["file"]).stem + SUFFIX)
    write_atomic(table, final)
    return {"file": final.name, "rows": table.num_rows, "bytes": final.stat().st_size,
            "sha256": sha256_file(final)}


def convert(root: str, log=print) -> dict[str, Any]:
    """Convert the format-1 folder ``root`` in place (see the module docstring); returns the new manifest.
    Raises DataError for a folder that is not a prepared folder of format 1."""
    dest = Path(root)
    path = dest / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        fmt = manifest.get("format")
        splits = manifest["splits"]
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise DataError(
            f"{path} cannot be read ({e}): --convert takes a folder written by rayconv.prepare") from None
    if fmt == FORMAT:
        log(f"prepare: {dest} is already of format {FORMAT}: nothing to convert")
        return manifest
    if fmt != FORMAT_PARQUET:
        raise DataError(f"{path} has format {fmt!r}: --convert reads {FORMAT_PARQUET} only")
    old = [e["file"] for s in splits.values() for e in s["shards"]]
    for split in splits.values():
        split["shards"] = [_convert_shard(dest, e) for e in split["shards"]]
    manifest["format"] = FORMAT
    write_manifest(dest, manifest)
    for name in old:
        (dest / name).unlink(missing_ok=True)
    log(f"prepare: converted {len(old)} shards of {dest} to {FORMAT}")
    return manifest


def _recode_shard(src: str, dest: str, entry: dict[str, Any], size: int, encoding: str,
                  quality: int) -> dict[str, Any]:
    """One shard of ``src`` re-encoded as ``encoding`` into ``dest`` (raw: each JPEG decoded, shorter side
    to ``size``, center crop, ``shard_writer.raw_pixels``; jpeg: each size x size image encoded at
    ``quality``); returns its manifest entry. Raises DataError when the shard does not match its entry."""
    import io

    import pyarrow as pa
    from PIL import Image

    path = Path(src) / entry["file"]
    if sha256_file(path) != entry["sha256"]:
        raise DataError(
            f"{path} does not match {MANIFEST} (sha256): prepare the folder again from its images")
    with pa.memory_map(str(path)) as f:
        table = pa.ipc.open_file(f).read_all()
    if encoding == "raw":
        images = [raw_pixels(Image.open(io.BytesIO(b)).convert("RGB"), size)
                  for b in table.column("jpeg").to_pylist()]
        hw = [size] * len(images)
    else:
        images = []
        for b in table.column("pixels").to_pylist():
            buf = io.BytesIO()
            Image.frombytes("RGB", (size, size), b).save(buf, "JPEG", quality=quality)
            images.append(buf.getvalue())
        hw = table.column("height").to_pylist()
    meta = json.loads(table.schema.metadata[SHARD_META])
    meta["settings"] = {**meta["settings"], **recoded_settings(meta["settings"], encoding, quality)}
    cols = {"index": table.column("index"), "label": table.column("label"), "height": hw, "width": hw,
            ("pixels" if encoding == "raw" else "jpeg"): images, "path": table.column("path")}
    schema = shard_schema(size if encoding == "raw" else None)
    out = pa.table(cols, schema=schema).replace_schema_metadata({SHARD_META: json.dumps(meta)})
    final = Path(dest) / entry["file"]
    write_atomic(out, final)
    return {"file": final.name, "rows": out.num_rows, "bytes": final.stat().st_size,
            "sha256": sha256_file(final)}


def recoded_settings(settings: dict[str, Any], encoding: str, quality: int) -> dict[str, Any]:
    """A converted folder's settings: the new ``encoding`` and ``quality``, and ``converted_from`` (the
    old encoding), so that prepare does not take its shards for ones written from the source images."""
    return {**settings, "encoding": encoding, "quality": quality if encoding == "jpeg" else None,
            "converted_from": settings.get("encoding", "jpeg")}


def convert_encoding(src: str, out: str, encoding: str, quality: int = 90, processes: Optional[int] = None,
                     log=print) -> dict[str, Any]:
    """The prepared folder ``src`` re-encoded as ``encoding`` (raw or jpeg) into the new or empty folder
    ``out`` (``python -m rayconv.prepare --convert SRC --encoding E --out OUT``), one process per shard;
    ``src`` is left as it is. Raw from JPEG shards holds the JPEGs' decoded pixels (their artifacts
    included); JPEG from raw shards holds the square crops. Returns the new manifest. Raises DataError
    for a folder that is not prepared, a shard that does not match its manifest, or an ``out`` that
    holds files."""
    root, dest = Path(src), Path(out)
    manifest = read_manifest(root)
    have = encoding_of(manifest)
    if have == encoding:
        raise DataError(f"{root} already holds {encoding} shards: give the other --encoding")
    if dest.resolve() == root.resolve() or (dest.is_dir() and any(dest.iterdir())):
        raise DataError(f"--out {dest} must be a new or empty folder (not the one converted)")
    dest.mkdir(parents=True, exist_ok=True)
    size = int(manifest["settings"]["size"])
    entries = [(split, i, e) for split, s in manifest["splits"].items() for i, e in enumerate(s["shards"])]
    with ProcessPoolExecutor(processes or os.cpu_count() or 1) as pool:
        done = list(pool.map(_recode_shard, *zip(*[(str(root), str(dest), e, size, encoding, quality)
                                                   for _, _, e in entries])))
    for (split, i, _), entry in zip(entries, done):
        manifest["splits"][split]["shards"][i] = entry
    manifest.update(format=FORMAT_RAW if encoding == "raw" else FORMAT, encoding=encoding,
                    settings=recoded_settings(manifest["settings"], encoding, quality))
    manifest.pop("image_shape", None)
    if encoding == "raw":
        manifest["image_shape"] = [size, size, 3]
    write_manifest(dest, manifest)
    log(f"prepare: {len(entries)} shards of {root} re-encoded as {encoding} -> {dest}")
    return manifest

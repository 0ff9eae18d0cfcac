"""A prepared folder of the older format ``rayconv-shards/1`` (Parquet shards) rewritten in place as
format ``rayconv-shards/2`` (Arrow IPC shards, ``rayconv/data/shard_files.py``): what ``python -m
rayconv.prepare --convert DIR`` runs.

Each Parquet shard is checked against its manifest entry (bytes, sha256), then written as
``<name>.arrow`` atomically (``shard_writer.write_atomic``: tmp, fsync, rename), with the same rows,
columns and schema metadata. The new manifest is written last (atomically), then the Parquet shards are
removed. Interrupted at any point, the folder is either still format 1 (the same command again
converts it) or complete in format 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rayconv.data.shard_files import FORMAT, FORMAT_PARQUET, MANIFEST, SUFFIX
from rayconv.data.shard_writer import shard_schema, write_atomic, write_manifest
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
        raise DataError(f"{src} holds {table.num_rows} rows, {MANIFEST} says {entry['rows']}: prepare the folder again")
    final = root / (Path(entry["file"]).stem + SUFFIX)
    write_atomic(table, final)
    return {"file": final.name, "rows": table.num_rows, "bytes": final.stat().st_size, "sha256": sha256_file(final)}


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
        raise DataError(f"{path} cannot be read ({e}): --convert takes a folder written by rayconv.prepare") from None
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

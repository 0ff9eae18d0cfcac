"""One shard file and the manifest of a prepared folder, written atomically: what ``prepare``
(``shard_writer.py``), ``--convert`` (``shard_convert.py``) and a generator of pixel arrays
(benchmarks/make_raw_shards.py) share, so that their folders are of one format (``shard_files.py``
describes it).

``write_rows`` writes one shard of given columns (a raw shard's pixels may be one uint8 array, taken
without a per-image copy) with its metadata and returns its manifest entry; ``make_manifest`` is the
manifest of a folder's splits; ``write_manifest`` writes it, last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from rayconv.data.shard_files import FORMAT, FORMAT_RAW, MANIFEST
from rayconv.files import sha256_file

# Arrow schema key-value metadata of a shard: its settings, inputs and skipped files
SHARD_META = b"rayconv.shard"


def shard_schema(raw_size: Optional[int] = None):
    """The columns of a shard (``rayconv/data/shard_files.py`` says what each holds): of JPEGs, or with
    ``raw_size`` S of raw pixels, a fixed-size binary column of S * S * 3 bytes (one data buffer with
    no offsets, so that a (rows, S, S, 3) numpy view of it is zero-copy; a FixedSizeList<uint8> would
    add a child array to every read for the same bytes)."""
    import pyarrow as pa

    image = ("jpeg", pa.binary()) if raw_size is None else ("pixels", pa.binary(raw_size * raw_size * 3))
    return pa.schema([("index", pa.int64()), ("label", pa.int32()), ("height", pa.int32()),
                      ("width", pa.int32()), image, ("path", pa.string())])


def write_atomic(table, final: Path) -> None:
    """Write ``table`` as the Arrow IPC file ``final``: into ``final.tmp``, uncompressed (JPEG bytes do
    not compress, and a reader maps them zero-copy), one record batch, fsynced, then renamed over
    ``final`` and the folder fsynced. On any failure (ENOSPC, EFBIG, an interrupt) the ``.tmp`` is removed
    and the error re-raised: ``final`` is either the old file, absent, or complete."""
    import pyarrow as pa

    tmp = final.with_name(final.name + ".tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks(), max_chunksize=max(1, table.num_rows))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_entry(path: Path, rows: int, sha: str) -> dict[str, Any]:
    """A shard's manifest entry: ``file``, ``rows``, ``bytes`` and ``sha256``."""
    return {"file": path.name, "rows": rows, "bytes": path.stat().st_size, "sha256": sha}


def write_manifest(dest: Path, manifest: dict[str, Any]) -> None:
    """``manifest.json`` written atomically (tmp, fsync, rename; the tmp removed on failure)."""
    tmp = dest / (MANIFEST + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(manifest, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_rows(final: Path, rows: dict[str, Any], meta: dict[str, Any], skipped: list[dict[str, str]],
               raw_size: Optional[int] = None) -> dict[str, Any]:
    """Shard ``final`` of ``rows`` (the columns of ``shard_schema(raw_size)``: lists or arrays; with
    ``raw_size`` S, ``pixels`` may be a uint8 array of (rows, S, S, 3) or (rows, S * S * 3), written
    without a per-image copy), its metadata ``meta`` (settings and ``inputs_sha256``) plus rows,
    ``skipped`` and per-label ``counts`` (in the order labels first appear), written by
    ``write_atomic``. Returns its manifest entry (``shard_entry``) plus ``skipped``, ``counts`` and
    ``resumed`` False. Raises OSError (a full disk) with no ``.tmp`` left behind; ValueError for pixels
    of another shape."""
    import numpy as np
    import pyarrow as pa

    labels = np.asarray(rows["label"], dtype=np.int64)
    if raw_size is not None and isinstance(rows["pixels"], np.ndarray):
        width = raw_size * raw_size * 3
        px = np.ascontiguousarray(rows["pixels"], dtype=np.uint8)
        if px.size != len(labels) * width:
            raise ValueError(
                f"pixels of shape {px.shape} for {len(labels)} images of {raw_size}x{raw_size}x3")
        rows = {**rows, "pixels": pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(labels),
                                                                       [None, pa.py_buffer(px.reshape(-1))])}
    found, firsts, n = np.unique(labels, return_index=True, return_counts=True)
    counts = {str(found[k]): int(n[k]) for k in np.argsort(firsts, kind="stable")}
    done = {**meta, "rows": len(labels), "skipped": skipped, "counts": counts}
    table = pa.table(rows, schema=shard_schema(raw_size)).replace_schema_metadata(
        {SHARD_META: json.dumps(done)}
    )
    write_atomic(table, final)
    return {**shard_entry(final, len(labels), sha256_file(final)), "skipped": skipped, "counts": counts,
            "resumed": False}


def make_manifest(source: str, settings: dict[str, Any], classes: list[str],
                  splits: dict[str, Any]) -> dict[str, Any]:
    """``manifest.json`` of a folder of ``settings["encoding"]`` shards (format 3 raw, 2 JPEG; raw ones
    add ``image_shape``): ``source``, ``settings``, ``classes`` and per split its images, per-class
    counts, skipped files and shard entries (``splits``)."""
    encoding = settings["encoding"]
    manifest = {"format": FORMAT_RAW if encoding == "raw" else FORMAT, "encoding": encoding, "source": source,
                "settings": settings, "classes": classes, "splits": splits}
    if encoding == "raw":
        manifest["image_shape"] = [settings["size"], settings["size"], 3]
    return manifest

"""The files of a prepared folder (``python -m rayconv.prepare``): its manifest, and each shard opened
memory-mapped for reading (``OpenShard``).

Format ``rayconv-shards/2``: ``manifest.json`` and Arrow IPC files (``pyarrow.ipc.new_file``,
uncompressed) ``train-00000.arrow``, ..., ``val-00000.arrow``, ... with columns ``index`` (the file's
position in its split's sorted listing), ``label`` (int32, position of its class in ``classes``),
``height``, ``width`` (int32, pixels), ``jpeg`` (binary: a baseline RGB JPEG, shorter side at most
``size``) and ``path`` (the source file, relative to the source folder). Sample ``k`` of a split is row
``k`` of its shards taken in order. The train rows follow the manifest's ``settings["shard_order"]``:
``shuffled`` (a permutation of the listing seeded by ``settings["seed"]``, so ``index`` is not ``k``
and each shard holds files of many classes) or ``sorted`` (listing order; folders whose settings lack
the key are sorted); val rows are in listing order. The manifest lists each shard's ``file``,
``rows``, ``bytes`` and ``sha256``.

Checks at open (``read_manifest``, ``OpenShard``): the manifest lists exactly the shard files present,
each with its byte size, and each file's Arrow footer reads with the listed row count; else DataError
names the file. The whole-file sha256 is not recomputed by every reader: prepare checks it when it
resumes (a shard is kept only when its sha256 matches the manifest), and ``--stage-dir`` checks it
when it copies shards to a node. During a run ``OpenShard.check`` compares the file's (inode, size,
mtime) with those at open before its bytes are read, so a shard that disappears, shrinks or changes
stops the run with DataError naming it (reading a memory-mapped file that shrank would raise SIGBUS).

Format ``rayconv-shards/3`` (``python -m rayconv.prepare --encoding raw``): the same files and columns, with
``pixels`` (fixed-size binary of ``size * size * 3`` bytes: the image as uint8 H x W x RGB, row-major,
``size`` x ``size``: shorter side resized to ``size``, then the center ``size`` x ``size`` crop) in place
of ``jpeg``; ``height`` = ``width`` = ``size``. Its manifest says ``"encoding": "raw"`` and
``"image_shape": [size, size, 3]``. A reader takes a batch's rows straight from the mapping (numpy
fancy indexing of a (rows, size, size, 3) view): nothing is decoded. Folders of format 2 hold JPEGs
(their manifest's ``encoding`` is ``jpeg`` or absent); prepare keeps writing format 2 for JPEGs, so
that older readers still read them.

Format ``rayconv-shards/1`` (Parquet shards) is refused with the command that converts it in place:
``python -m rayconv.prepare --convert DIR``.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayconv.data.folders import SPLITS
from rayconv.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "rayconv-shards/2"           # JPEG shards
# raw-pixel shards (``encoding`` raw): older readers refuse them by format
FORMAT_RAW = "rayconv-shards/3"
FORMATS = (FORMAT, FORMAT_RAW)
FORMAT_PARQUET = "rayconv-shards/1"   # the older format: Parquet shards, converted by --convert
SUFFIX = ".arrow"


def is_prepared(path: Optional[str]) -> bool:
    """Whether ``path`` is a folder written by ``python -m rayconv.prepare`` (has its manifest)."""
    return bool(path) and (Path(path) / MANIFEST).is_file()


def convert_hint(root: Path) -> str:
    return f"convert it with `python -m rayconv.prepare --convert {root}`"


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a prepared folder, checked against the files present: every listed shard exists
    with its byte size, and no unlisted shard is there. Raises DataError for a folder that does not exist,
    naming what does not match, and for a folder of the older format (Parquet shards) naming the command that
    converts it."""
    path = root / MANIFEST
    if not root.is_dir():
        raise DataError(
            f"{root} does not exist: check --data-dir (a folder written by python -m rayconv.prepare)")
    if not path.is_file():
        raise DataError(
            f"{root} has no {MANIFEST}: prepare it with `python -m rayconv.prepare {root} --out"
            f" {root.parent / (root.name + '-shards')}` and give that --data-dir, or read its images with"
            " --data imagefolder"
        )
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") == FORMAT_PARQUET:
            raise DataError(f"{root} holds shards of the older format {FORMAT_PARQUET} (Parquet): "
                            f"{convert_hint(root)}")
        assert manifest.get("format") in FORMATS, f"format {manifest.get('format')!r}, not one of {FORMATS}"
        assert encoding(manifest) in ("jpeg", "raw"), f"encoding {manifest.get('encoding')!r}"
        listed = {e["file"]: e for split in SPLITS.values() for e in manifest["splits"][split]["shards"]}
    except (ValueError, AssertionError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path} is not a rayconv shard manifest ({e}): prepare the folder again") from None
    present = {p.name for p in root.glob("*" + SUFFIX)}
    for name in sorted(set(listed) - present):
        raise DataError(f"{root / name} is listed in {MANIFEST} but missing: run `python -m rayconv.prepare` "
                        f"again with --out {root} (it rewrites what is missing)")
    for name in sorted(present - set(listed)):
        raise DataError(f"{root / name} is not listed in {MANIFEST}: remove it or prepare the folder again")
    for name, entry in sorted(listed.items()):
        size = (root / name).stat().st_size
        if size != entry["bytes"]:
            raise DataError(f"{root / name} has {size} bytes, {MANIFEST} says {entry['bytes']}: run "
                            f"`python -m rayconv.prepare` again with --out {root} (it rewrites bad shards)")
    return manifest


def encoding(manifest: dict[str, Any]) -> str:
    """A manifest's image encoding: ``jpeg`` or ``raw`` (format 2 without the key: ``jpeg``)."""
    return manifest.get("encoding", "jpeg")


def folder_encoding(root: Optional[str]) -> str:
    """The encoding a prepared folder's manifest names (``jpeg`` when it has none or does not read:
    the JPEG reader then names what is wrong)."""
    try:
        return encoding(json.loads((Path(root or "") / MANIFEST).read_text()))
    except (OSError, ValueError, AttributeError):
        return "jpeg"


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class OpenShard:
    """One shard file, memory-mapped read-only (``mmap``, shared: its pages live in the OS page cache,
    shared by every process of the node that maps it, so reading it adds no private memory), its Arrow
    IPC footer and record batches read from the mapping zero-copy (``pa.ipc.open_file``).

    ``columns(names)``: numpy copies of small columns (labels, sizes). ``pieces``: per record batch
    (first row, JPEG bytes uint8 view, offsets int32 view; raw shards: (rows, size * size * 3) uint8
    view, None), views into the mapping, zero-copy; ``raw``: whether it holds raw pixels.
    ``ranges(rows)``: the (file offset, length) of those rows' bytes, for read-ahead. Raises
    DataError naming the file when its Arrow footer does not read or its rows differ from ``rows``."""

    def __init__(self, path: Path, rows: int):
        import pyarrow as pa   # (pyarrow's import is slow: only where shards are read)

        self.path = path
        self.checked_at = float("-inf")   # (time.monotonic() of the last check that passed)
        try:
            # The mapping outlives the file descriptor (closed here), so a folder of thousands of shards
            # holds no open files; Arrow reads the record batches from it zero-copy.
            with open(path, "rb") as f:
                self.identity = _identity(os.fstat(f.fileno()))
                self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            whole = pa.py_buffer(self.mmap)
            base = whole.address
            reader = pa.ipc.open_file(whole)
            self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (OSError, ValueError, pa.ArrowException) as e:   # ValueError: an empty file
            raise DataError(f"{path} is not a readable Arrow shard ({e}): run `python -m rayconv.prepare` "
                            f"again with --out {path.parent} (it rewrites bad shards)") from None
        self.rows = sum(b.num_rows for b in self.batches)
        if self.rows != rows:
            raise DataError(f"{path} holds {self.rows} rows, {MANIFEST} says {rows}: run `python -m "
                            f"rayconv.prepare` again with --out {path.parent} (it rewrites bad shards)")
        # Per record batch: (first row, bytes, offsets). JPEG: the column's bytes (uint8) and its int32
        # offsets; raw: a (rows, size * size * 3) uint8 view of the fixed-size column, offsets None.
        self.pieces: list[tuple[int, np.ndarray, Optional[np.ndarray]]] = []
        self.base, first = base, 0
        self.raw = bool(self.batches) and "pixels" in self.batches[0].schema.names
        for b in self.batches:
            if self.raw:
                col = b.column("pixels")
                width = col.type.byte_width
                data = col.buffers()[1]
                flat = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
                self.pieces.append((first, flat[col.offset * width:(col.offset + len(col)) * width]
                                    .reshape(len(col), width), None))
            else:
                col = b.column("jpeg")
                _, offsets, data = col.buffers()
                off = np.frombuffer(offsets, dtype=np.int32)[col.offset:col.offset + len(col) + 1]
                raw = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
                self.pieces.append((first, raw, off))
            first += b.num_rows
        self.starts = np.asarray([p[0] for p in self.pieces] + [first])

    def columns(self, names: list[str]) -> dict[str, np.ndarray]:
        out = {n: [b.column(n).to_numpy() for b in self.batches] for n in names}
        return {n: np.concatenate(v) if v else np.zeros(0, np.int32) for n, v in out.items()}

    def jpeg(self, row: int) -> np.ndarray:
        """Row ``row``'s JPEG bytes (raw shards: its pixel bytes): a uint8 view into the mapping."""
        k = int(np.searchsorted(self.starts, row, side="right")) - 1
        first, data, off = self.pieces[k]
        r = row - first
        return data[r] if off is None else data[off[r]:off[r + 1]]

    def ranges(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """The (file offset, length) of the bytes of ``rows``, sorted, ranges closer than 4 KiB merged."""
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        if self.raw:
            k = np.searchsorted(self.starts, rows, side="right") - 1
            width = self.pieces[0][1].shape[1]
            firsts = np.asarray([p[0] for p in self.pieces], np.int64)
            addr = np.asarray([p[1].ctypes.data - self.base for p in self.pieces], np.int64)
            starts = addr[k] + (rows - firsts[k]) * width
            ends = starts + width
        else:
            views = [self.jpeg(int(row)) for row in rows]
            views = [v for v in views if len(v)]
            starts = np.asarray([v.ctypes.data - self.base for v in views], np.int64)
            ends = starts + np.asarray([len(v) for v in views], np.int64)
        if not len(starts):
            return []
        # (merged without per-row Python: a range starts where a row begins more than 4 KiB past the
        # furthest end of the rows before it)
        reach = np.maximum.accumulate(ends)
        firsts = np.flatnonzero(np.r_[True, starts[1:] > reach[:-1] + 4096])
        lasts = np.r_[firsts[1:], len(starts)] - 1
        return list(zip(starts[firsts].tolist(), (reach[lasts] - starts[firsts]).tolist()))

    def will_need(self, rows: np.ndarray) -> None:
        """Ask the kernel to read the pages of ``rows``' bytes now (``POSIX_FADV_WILLNEED``: returns at
        once, the reads go on in the background), so that decoding them later does not wait on the disk."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return   # gone: ``check`` names it before the bytes are read
        try:
            for off, n in self.ranges(rows):
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def will_need_mapped(self, rows: np.ndarray) -> None:
        """As ``will_need``, through the mapping (``madvise(MADV_WILLNEED)``: no file opened),
        page-aligned."""
        self.will_need_ranges(self.ranges(rows))

    def will_need_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """``will_need_mapped`` of (file offset, length) ``ranges`` (as ``ranges`` gives them)."""
        advise = getattr(self.mmap, "madvise", None)
        flag = getattr(mmap, "MADV_WILLNEED", None)
        if advise is None or flag is None:
            return
        page, size = mmap.PAGESIZE, len(self.mmap)
        for off, n in ranges:
            start = off - off % page
            try:
                advise(flag, start, min(off + n, size) - start)
            except (OSError, ValueError):
                return   # (a changed file: ``check`` names it before the bytes are read)

    def check(self, max_age_s: float = 0.0) -> None:
        """Raise DataError naming the file if it disappeared, or its inode, size or mtime changed since open.
        With ``max_age_s``, a shard whose last check passed less than that many seconds ago is not
        checked again (a reader touching many shards a batch makes one ``stat`` per shard per interval,
        not per batch)."""
        now_s = time.monotonic()
        if max_age_s and now_s - self.checked_at < max_age_s:
            return
        try:
            now: Optional[tuple] = _identity(os.stat(self.path))
        except OSError:
            now = None
        if now == self.identity:
            self.checked_at = now_s
        else:
            what = (
                "disappeared"
                if now is None
                else "changed (inode, size or mtime differ from when it was opened)"
            )
            raise DataError(
                f"{self.path} {what} during the run: put the file back as prepared and continue with "
                "--resume (the last checkpoint stays)")

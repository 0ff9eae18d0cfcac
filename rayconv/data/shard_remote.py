"""The pieces of a prepared set in object storage that a stream reads without fetching the set whole
(``shard_stream``): each shard's small columns read from the storage (``read_columns``), a shard as the
sources hold it (``StreamedShard``), what a source's batches read (``StreamReads``), the rows of a batch
copied from mapped raw shards (``copy_rows``), the least budget a streamed set needs (``min_window``),
and the removal of a stream's folder no process holds (``remove_if_free``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayconv.data.shard_files import OpenShard
from rayconv.errors import DataError
from rayconv.storage import StorageError

THREADS = 4   # concurrent reads of shards' columns


class StreamedShard:
    """A shard of a stream as a source holds it: ``name``, ``rows``, ``columns(names)`` (read at open),
    ``open`` (its ``OpenShard`` while a read maps it, else None); ``jpeg``, ``check`` and the read-ahead
    calls as ``OpenShard``'s (no-ops while unmapped: the stream checks what it fetches)."""

    def __init__(self, name: str, rows: int, cols: dict[str, np.ndarray], path: Path):
        self.name, self.rows, self.cols, self.path = name, rows, cols, path
        self.open: Optional[OpenShard] = None

    def columns(self, names: list[str]) -> dict[str, np.ndarray]:
        return {n: self.cols[n] for n in names}

    def jpeg(self, row: int) -> np.ndarray:
        assert self.open is not None, f"{self.name} is read outside a stream read"
        return self.open.jpeg(row)

    def check(self, max_age_s: float = 0.0) -> None:
        if self.open is not None:
            self.open.check(max_age_s)

    def will_need(self, rows: np.ndarray) -> None:
        """(fetched and mapped by the stream when read)"""

    def will_need_ranges(self, ranges) -> None:
        """(fetched and mapped by the stream when read)"""


def read_columns(cache: Any, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Per shard file, the columns ``names`` as numpy arrays, read from the storage: the Arrow footer
    and those columns' buffers alone. Raises StorageError / DataError (one line)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    files = list(cache.entries)

    def one(name: str) -> dict[str, np.ndarray]:
        src = cache.location / name
        try:
            with src.fs.open_input_file(src.path) as f:
                schema = ipc.open_file(f).schema
                fields = [schema.get_field_index(n) for n in names]
                if min(fields, default=0) < 0:
                    raise DataError(f"--data-dir {cache.uri}: {name} lacks a column of {names}: prepare the "
                                    "folder again")
                reader = ipc.open_file(f, options=ipc.IpcReadOptions(included_fields=fields))
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (OSError, pa.ArrowException) as e:
            text = str(e).strip().splitlines()
            raise StorageError(f"--data-dir {cache.uri}: reading {name}'s columns failed "
                               f"({text[0] if text else type(e).__name__}): run again") from None
        out = {n: np.concatenate([b.column(n).to_numpy() for b in batches]) if batches
               else np.zeros(0, np.int32) for n in names}
        rows = int(cache.entries[name]["rows"])
        if any(len(v) != rows for v in out.values()):
            raise DataError(f"--data-dir {cache.uri}: {name} holds other than its {rows} rows: prepare the "
                            "folder again")
        return out

    with ThreadPoolExecutor(THREADS) as pool:
        return dict(zip(files, pool.map(one, files)))


def files_of(shards: list, starts: np.ndarray, idx: np.ndarray) -> frozenset:
    """The names of the shards (``StreamedShard``; ``starts``: each one's first sample, then the total)
    that samples ``idx`` lie in."""
    shard = np.searchsorted(starts, np.asarray(idx), side="right") - 1
    return frozenset(shards[s].name for s in np.unique(shard))


class StreamReads:
    """``files`` and ``foresee`` of a shard source (its ``stream``, ``shards`` and ``starts`` per split)."""

    stream: Any = None

    def files(self, split: str, idx: np.ndarray) -> frozenset:
        """The names of the shard files samples ``idx`` of ``split`` lie in."""
        return files_of(self.shards[split], self.starts[split], idx)   # type: ignore[attr-defined]

    def foresee(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """The batches of ``split`` after those announced (a streamed set: they order its cache's
        evictions; nothing is read)."""
        if self.stream is not None:
            self.stream.foresee(split, [self.files(split, np.asarray(b)) for b in batches if len(b)])


def copy_rows(shards: list, starts: np.ndarray, idx: np.ndarray, opened: dict[str, OpenShard],
              out: np.ndarray) -> None:
    """Rows ``idx`` of raw shards ``shards`` (mapped: ``opened`` by name) into ``out`` (len(idx), width)
    uint8. IndexError for a sample outside the split."""
    if len(idx) and (idx.min() < 0 or idx.max() >= starts[-1]):
        bad = idx[(idx < 0) | (idx >= starts[-1])][0]
        raise IndexError(f"sample {bad} is outside the split's {starts[-1]} rows")
    shard = np.searchsorted(starts, idx, side="right") - 1
    for s in np.unique(shard).tolist():
        at = np.flatnonzero(shard == s)
        rows = idx[at] - starts[s]
        sh = opened[shards[s].name]
        piece = np.searchsorted(sh.starts, rows, side="right") - 1
        for k in np.unique(piece).tolist():
            sel = piece == k
            first, data, _ = sh.pieces[k]
            out[at[sel]] = data[rows[sel] - first]


def min_window(cfg: Any, source: Any) -> tuple[int, int]:
    """(bytes, shards) of the largest set of shards one replica's batch of epoch 0 touches: the least
    ``--cache-bytes`` a streamed set needs (one reading actor a node). ``source``: the driver's
    ``ManifestSource``."""
    from rayconv.data.order import make_order
    from rayconv.data.source import Sharding

    train = source.manifest["splits"]["train"]["shards"]
    sizes = np.asarray([int(e["bytes"]) for e in train], np.int64)
    starts = np.cumsum([0] + [int(e["rows"]) for e in train])
    sharding = Sharding(source.train_size, cfg.global_batch_size, cfg.seed, make_order(cfg, source),
                        cfg.val_split)
    dp = cfg.dp or 1
    best = (0, 0)
    for step in range(sharding.steps_per_epoch):
        for r in range(dp):
            idx = sharding.replica_batch(0, step, r, dp)[0]
            touched = np.unique(np.searchsorted(starts, idx, side="right") - 1)
            best = max(best, (int(sizes[touched].sum()), len(touched)))
    return best


def remove_if_free(folder: Path) -> None:
    """Remove ``folder`` when no process holds its shared lock (nor its set's fetch lock)."""
    fds = []
    lock = folder.parent / f".{folder.name}.lock"   # (a whole set's fetch lock; a stream has none)
    try:
        for path in ((lock, folder) if lock.exists() else (folder,)):
            fds.append(os.open(path, os.O_RDWR if path != folder else os.O_RDONLY))
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return
    finally:
        free = len(fds) == (2 if lock.exists() else 1)
        for fd in fds:
            os.close(fd)
    if free:
        shutil.rmtree(folder, ignore_errors=True)

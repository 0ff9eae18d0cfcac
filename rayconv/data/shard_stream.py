"""A prepared set in object storage larger than ``--cache-bytes``, streamed through the node's cache
(a set that fits is fetched whole once per node and reused: ``cache.ShardCache.ready``).

The order. Each process that reads images (the first pipeline stage) has a stream, told the reads to
come (``Source.prefetch``: the rest of an epoch, each evaluation; ``foresee``: the next epoch): a
``plan`` of the shard files each read touches, a split's new announcement replacing its entries and
going first. The order comes from (seed, epoch) alone (``data.order``), never from where the bytes are.

Fetches. A background thread walks the plan from its front and fetches each shard not on disk,
``THREADS`` at a time, each object one whole read through ``pyarrow.fs`` into a file made to its full
size first (the disk holds what is reserved), hashed as written, checked against the manifest's size
and sha256 and renamed into place (DataError naming a shard that does not match; StorageError when the
storage fails: the read that waits for it raises).

Evictions (Belady's rule: the future reads are known). Before a fetch, while the node's cache plus the
shard would exceed the budget, or this stream's files its share (the budget divided among the set's
streams on the node), the shard on disk whose next read lies furthest ahead (never read again: first)
is removed, if that read lies after the read the fetch is for; otherwise the fetch waits for the reads
to move on. A shard being read or mapped is never removed (a read maps its shards once on disk and
unmaps at its end those the next read does not touch). ``events``: every fetch and eviction.

The budget must hold one read's shards: a larger read is refused in one line (DataError) saying what to
change (``--cache-bytes``, ``--shuffle block``); the driver refuses before Ray a budget below one
replica's batch of epoch 0 (``shard_remote.min_window``). Labels (and JPEG image sizes) are read at
open from the shards' footers and those columns alone (``shard_remote.read_columns``), and compared
with a fetched shard's when it is first mapped.

Files: ``<cache>/<set key>.s<pid>-<n>/`` a stream (under a shared ``flock``; removed at ``close``, when
collected, or, held by no process, by the next stream of the node), the accounting under a ``flock`` on
``<cache>/.<set key>.stream.lock``. The fetcher looks again when the plan changed, else every
``RETRY_S`` s.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import time
import weakref
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from rayconv.data.cache import PART, ShardCache, default_budget, size_text
from rayconv.data.shard_files import OpenShard, encoding
from rayconv.data.shard_remote import StreamedShard, read_columns, remove_if_free
from rayconv.errors import DataError, first_line
from rayconv.files import node_lock
from rayconv.settings import DataSettings
from rayconv.storage import StorageError

THREADS = 4       # concurrent whole-object reads per stream
POLL_S = 0.05     # seconds a waiting read sleeps before looking again
RETRY_S = 0.5     # seconds a fetcher with nothing changed here waits before looking again (other streams)
STALL_S = 600.0   # seconds a read waits, nothing being fetched, before it names what holds the cache

_STREAMS = itertools.count()   # (each stream of this process a folder of its own)


def open_stream(cfg: DataSettings) -> Optional["ShardStream"]:
    """The stream of ``cfg.data_dir`` (a remote URI) for this process, or None when the set fits
    ``--cache-bytes`` (then it is fetched whole: ``cache.local_folder``)."""
    cache = ShardCache(cfg.data_dir, cfg.cache_dir, cfg.cache_bytes)
    cache.root.mkdir(parents=True, exist_ok=True)
    budget = cfg.cache_bytes if cfg.cache_bytes is not None else default_budget(cache.root)
    if cache.set_bytes <= budget:
        return None
    raw = encoding(cache.manifest) == "raw"   # (the columns its source reads at open)
    return ShardStream(cache, budget, ["label"] if raw else ["label", "height", "width"])


class _Read:
    """One plan entry: the shard files one read of ``split`` touches."""

    __slots__ = ("split", "files", "ahead")

    def __init__(self, split: str, files: frozenset, ahead: bool = False):
        self.split, self.files, self.ahead = split, files, ahead


class ShardStream:
    """This process's stream of the remote set ``cache`` describes, within ``budget`` bytes on the node
    (module docstring). ``handles(split_folder)``: the ``StreamedShard`` of that folder's shards;
    ``announce(split, reads)``; ``read(split, files)``: a context that yields {file: OpenShard}.
    Raises DataError / StorageError as the module says."""

    def __init__(self, cache: ShardCache, budget: int, columns: list[str]):
        self.cache, self.budget, self.uri = cache, budget, cache.uri
        self.manifest = cache.manifest
        self.root = cache.root
        self.root.mkdir(parents=True, exist_ok=True)
        self.key = cache.folder.name
        self.folder = self.root / f"{self.key}.s{os.getpid()}-{next(_STREAMS)}"
        self.lock_path = self.root / f".{self.key}.stream.lock"
        self.sizes = {name: int(e["bytes"]) for name, e in cache.entries.items()}
        self.cols = read_columns(cache, columns)
        self.shards = {name: StreamedShard(name, int(e["rows"]), self.cols[name], self.folder / name)
                       for name, e in cache.entries.items()}
        self.plan: list[_Read] = []
        self.present: set[str] = set()
        self.flight: set[str] = set()
        self.reading: dict[str, int] = {}   # file -> reads under way that touch it
        self.checked: set[str] = set()      # files whose labels were compared since their fetch
        self.cond = threading.Condition()
        self.error: Optional[BaseException] = None
        # (fetch | evict, file, bytes the cache holds after, reads ended before, the files it could evict)
        self.events: list[tuple[str, str, int, int, tuple]] = []
        self.done = 0   # reads ended
        self._held: list[int] = []   # (the fd holding the folder's shared lock)
        self._ended: Optional[weakref.finalize] = None
        self._thread: Optional[threading.Thread] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._stop = False
        self._version = 0

    # ------------------------------------------------------------------ the source's side
    def handles(self, folder_split: str) -> list[StreamedShard]:
        return [self.shards[e["file"]] for e in self.manifest["splits"][folder_split]["shards"]]

    def share(self) -> int:
        """This process's share of the budget: divided among the streams of the set on the node."""
        streams = max(1, len(list(self.root.glob(f"{self.key}.s*"))))
        return self.budget // streams

    def need(self, files) -> int:
        return sum(self.sizes[f] for f in files)

    def _check_fits(self, reads: list[frozenset]) -> None:
        share = self.share()
        need, files = max(((self.need(f), f) for f in reads), key=lambda x: x[0], default=(0, frozenset()))
        if need > share:
            streams = self.budget // max(1, share)
            raise DataError(
                f"--cache-bytes {self.budget}: one batch reads {len(files)} shards ({size_text(need)}) "
                f"of --data-dir {self.uri}, more than this actor's share of the node's cache "
                f"({size_text(share)}, {streams} reading actor(s) on the node): raise --cache-bytes to at "
                f"least {need * streams}, or use --shuffle block (a batch then reads one window of "
                "--shuffle-window shards)")

    def announce(self, split: str, reads: list[frozenset]) -> None:
        """The reads of ``split`` to come, in order (each: the files it touches); they replace the
        split's earlier ones and go before the other splits'. Raises DataError for a read larger than
        this process's share (``_check_fits``)."""
        self._start()
        self._check_fits(reads)
        with self.cond:
            self.plan = [_Read(split, f) for f in reads] + [r for r in self.plan if r.split != split]
            self._changed()

    def foresee(self, split: str, reads: list[frozenset]) -> None:
        """The reads of ``split`` after those announced (the next epoch's, known from (seed, epoch)):
        they replace the split's earlier foreseen reads and follow its announced ones; they order the
        evictions and, with room left, the fetches."""
        self._check_fits(reads)
        with self.cond:
            plan = [r for r in self.plan if not (r.split == split and r.ahead)]
            at = max((i + 1 for i, r in enumerate(plan) if r.split == split), default=0)
            self.plan = plan[:at] + [_Read(split, f, ahead=True) for f in reads] + plan[at:]
            self._changed()

    @contextlib.contextmanager
    def read(self, split: str, files: frozenset) -> Iterator[dict[str, OpenShard]]:
        """Wait until ``files`` are on disk (this read made the plan's next one: the announced read
        it matches, else a read of its own), map them and yield {file: OpenShard}; at the end unmap
        those the next read does not touch."""
        self._start()
        self._check_fits([files])
        with self.cond:
            entry = next((r for r in self.plan if r.split == split), None)
            if entry is not None and entry.files == files:
                self.plan.remove(entry)
            else:
                entry = _Read(split, files)
            self.plan.insert(0, entry)
            for f in files:
                self.reading[f] = self.reading.get(f, 0) + 1
            self._changed()
            try:
                since = time.monotonic()
                while not files <= self.present:
                    if self.error is not None:
                        raise self.error
                    if time.monotonic() - since > STALL_S and not self.flight:
                        raise DataError(f"--cache-dir {self.root}: {size_text(self.used())} held by other "
                                        f"sets or streams in use, {size_text(self.need(files))} needed for "
                                        f"one batch of {self.uri}: raise --cache-bytes or wait for the "
                                        "other runs")
                    self.cond.wait(POLL_S)
            except BaseException:
                self._end_read(entry)
                raise
        try:
            opened = {f: self._map(f) for f in sorted(files)}
            yield opened
        finally:
            self._end_read(entry)

    def _map(self, name: str) -> OpenShard:
        sh = self.shards[name]
        if sh.open is None:
            sh.open = OpenShard(sh.path, sh.rows)
            if name not in self.checked:
                got = sh.open.columns(["label"])["label"]
                if not np.array_equal(got, self.cols[name]["label"]):
                    raise DataError(f"--data-dir {self.uri}: {name}'s labels differ from those read at open "
                                    "(the set changed in the storage during the run): run again")
                self.checked.add(name)
        return sh.open

    def _end_read(self, entry: _Read) -> None:
        with self.cond:
            if entry in self.plan:
                self.plan.remove(entry)
            self.done += 1
            for f in entry.files:
                self.reading[f] -= 1
                if not self.reading[f]:
                    del self.reading[f]
            keep = self.plan[0].files if self.plan else frozenset()
            for sh in self.shards.values():
                if sh.open is not None and sh.name not in keep and sh.name not in self.reading:
                    sh.open = None   # (unmapped as its last reference goes)
            self._changed()

    # ------------------------------------------------------------------ the fetcher
    def _start(self) -> None:
        if self._thread is not None:
            return
        with node_lock(self.lock_path):
            self.folder.mkdir(exist_ok=True)
            self._held = [os.open(self.folder, os.O_RDONLY)]
            fcntl.flock(self._held[0], fcntl.LOCK_SH)
            for other in self.root.iterdir():   # (stale streams, other sets: removed where not in use)
                if other.is_dir() and other != self.folder:
                    remove_if_free(other)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="rayconv-fetch")
        # (the thread holds the stream weakly, so that a source no longer used ends its stream: the
        # finaliser stops the thread and removes the folder)
        self._thread = threading.Thread(target=_run, args=(weakref.ref(self),), name="rayconv-stream",
                                        daemon=True)
        self._ended = weakref.finalize(self, _end, self._held, self.folder, self.lock_path, self._pool)
        self._thread.start()

    def close(self) -> None:
        """Stop the fetcher and remove this stream's folder (a later announcement or read starts it
        again, empty)."""
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sh in self.shards.values():
            sh.open = None
        if self._ended is not None:
            with self.cond:
                self._ended()   # (the pool's fetches end first)
                self.present.clear()
                self.flight.clear()
                self.checked.clear()
        self._thread, self._pool, self._ended, self._stop = None, None, None, False

    def _changed(self) -> None:
        """(under ``cond``) The plan, the reads or the files changed: the fetcher looks again."""
        self._version += 1
        self.cond.notify_all()

    def used(self) -> int:
        """Bytes the node's cache holds now (every set's and stream's files, reservations included)."""
        return sum(p.stat().st_size for p in self.root.glob("*/*") if p.is_file())

    def _own(self) -> int:
        return self.need(self.present | self.flight)

    def _look(self, seen: int, looked: float) -> tuple[Optional[str], int, float]:
        """One look of the fetcher (``_run``): (a file to fetch now or None, the plan's version seen,
        when it looked)."""
        with self.cond:
            if seen == self._version and time.monotonic() - looked < RETRY_S:
                return None, seen, looked   # (nothing changed here: the plan is not walked again)
            seen, looked = self._version, time.monotonic()
            try:
                name = self._next_fetch()
            except BaseException as e:   # (a full disk, a failed eviction)
                self.error = e
                self._changed()
                return None, seen, looked
            return name, (-1 if name else seen), looked

    def _next_fetch(self) -> Optional[str]:
        """The next file to fetch, its bytes reserved on disk (evicting by Belady's rule), or None."""
        nxt: dict[str, int] = {}   # (the next read of each file on disk: the plan walked until all are found)
        left = len(self.present)
        for i, r in enumerate(self.plan):
            for f in r.files:
                if f not in nxt:
                    nxt[f] = i
                    left -= f in self.present
            if not left:
                break
        never = len(self.plan)
        with node_lock(self.lock_path):
            share = self.share()
            while self._own() > share and self._evict(nxt, never, 0):
                pass   # (more streams came: this one gives back what it reads later)
            for i, r in enumerate(self.plan):
                for f in sorted(r.files - self.present - self.flight):
                    if len(self.flight) >= THREADS:
                        return None
                    size = self.sizes[f]
                    while self._own() + size > share or self.used() + size > self.budget:
                        if not self._evict(nxt, never, i):
                            return None
                    tmp = self.folder / f".{f}.part"
                    with open(tmp, "wb") as out:
                        out.truncate(size)
                    self.flight.add(f)
                    return f
        return None

    def _evict(self, nxt: dict[str, int], never: int, before: int) -> bool:
        """Remove the file on disk whose next read is furthest ahead, if it lies after read ``before``
        (and the file is neither read nor mapped now). Returns whether one was removed."""
        free = [f for f in self.present if f not in self.reading and self.shards[f].open is None]
        if not free:
            return False
        victim = max(free, key=lambda f: (nxt.get(f, never), f))
        if nxt.get(victim, never) <= before:
            return False
        (self.folder / victim).unlink(missing_ok=True)
        self.present.discard(victim)
        self.checked.discard(victim)
        self.events.append(("evict", victim, self.used(), self.done, tuple(sorted(free))))
        return True

    def _fetch(self, name: str) -> None:
        tmp, size = self.folder / f".{name}.part", self.sizes[name]
        try:
            digest, written = hashlib.sha256(), 0
            src = self.cache.location / name
            try:
                with src.fs.open_input_stream(src.path) as f, open(tmp, "r+b") as out:
                    while written <= size:
                        chunk = f.read(PART)
                        if not chunk:
                            break
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
            except OSError as e:
                raise StorageError(f"--data-dir {self.uri}: reading {name} failed ({first_line(e)}): "
                                   "run again (or --resume)") from None
            if written != size or digest.hexdigest() != self.cache.entries[name]["sha256"]:
                raise self.cache.mismatch(name)
            with self.cond:
                os.replace(tmp, self.folder / name)
                self.flight.discard(name)
                self.present.add(name)
                self.events.append(("fetch", name, self.used(), self.done, ()))
                self._changed()
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            with self.cond:
                self.flight.discard(name)
                self.error = e
                self._changed()


def _run(ref: "weakref.ref[ShardStream]") -> None:
    """The fetcher thread: looks, hands each file to fetch to the pool, waits; ends with its stream
    (stopped, failed or collected)."""
    seen, looked = -1, 0.0
    while True:
        stream = ref()
        if stream is None or stream._stop or stream.error is not None:
            return
        name, seen, looked = stream._look(seen, looked)
        if name is not None:
            stream._pool.submit(stream._fetch, name)
            continue
        cond = stream.cond
        del stream   # (not held while waiting)
        with cond:
            cond.wait(POLL_S)


def _end(held: list, folder: Path, lock_path: Path, pool: ThreadPoolExecutor) -> None:
    """A stream's end: its fetches finished, its folder's lock given back and the folder removed."""
    pool.shutdown(wait=True)
    while held:
        os.close(held.pop())
    with node_lock(lock_path):
        shutil.rmtree(folder, ignore_errors=True)

"""A prepared set in object storage larger than ``--cache-bytes``, streamed through the node's cache.

A set that fits the budget is fetched whole once per node and reused (``cache.ShardCache.ready``). A
larger one is read through a ``ShardStream`` of each process that reads images (an actor of the first
pipeline stage): the shards its reads need, in the order it reads them, fetched ahead by a background
thread, at most ``--cache-bytes`` on the node's disk.

The order. The source announces the index arrays it will read (``Source.prefetch``: the rest of an
epoch, the next epoch during the last step, each evaluation); each read is one ``plan`` entry, the set
of shard files it touches. A new announcement of a split replaces that split's entries and goes before
the other splits' (an evaluation is read before the training that resumes after it). The order comes
from (seed, epoch) alone (``data.order``), never from where the bytes are: the batches, their
augmentation, the equality with single-device SGD and resume are those of a local folder.

Fetches. The thread walks the plan from its front and fetches each shard not on disk, ``THREADS``
at a time, each object one whole read through ``pyarrow.fs`` (``open_input_stream``) into a file
made to its full size first (so that the disk holds what is reserved), hashed as it is written, checked
against the manifest's size and sha256 and renamed over its name (DataError naming a shard that does
not match; StorageError when the storage fails: the read that waits for it raises).

Evictions (Belady's rule: the future reads are known). Before a fetch, while the node's cache plus the
shard would exceed the budget, or this process's files its share (the budget divided among the
streams of the set on the node), the shard on disk whose next read lies furthest ahead (never read
again: first) is removed, if that read lies after the read the fetch is for; otherwise the fetch waits
for the reads to move on. A shard being read, or mapped, is never removed: a read maps its shards
(``OpenShard``) after they are on disk and unmaps those the next read does not touch when it ends.
Every fetch and eviction is recorded in ``events`` with the bytes the cache holds after it and the
number of reads ended before it.

The budget must hold the shards of one read: a read that touches more than this process's share is
refused in one line (DataError) saying what to change: a larger ``--cache-bytes``, or ``--shuffle
block`` (a batch then reads one window of ``--shuffle-window`` shards); the driver refuses, before Ray,
a budget below one replica's batch of epoch 0 (``shard_remote.min_window``).

Labels (and JPEG shards' image sizes) are read at open from each shard's Arrow footer and those
columns' buffers alone (``shard_remote.read_columns``: a few KB a shard); a fetched shard's labels are
compared with them when it is first mapped.

Files: ``<cache>/<set key>.s<pid>/`` per process (held by a shared ``flock`` while the process reads it;
a folder no process holds is removed by the next stream of the node, as are other sets' folders not in
use), the accounting under an exclusive ``flock`` on ``<cache>/.<set key>.stream.lock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from rayconv.data.cache import PART, ShardCache, default_budget
from rayconv.data.shard_files import OpenShard, encoding
from rayconv.data.shard_remote import StreamedShard, read_columns
from rayconv.errors import DataError
from rayconv.storage import StorageError

THREADS = 4       # concurrent whole-object reads per stream
POLL_S = 0.05     # seconds a waiting fetcher or read sleeps before looking again


def open_stream(cfg: Any) -> Optional["ShardStream"]:
    """The stream of ``cfg.data_dir`` (a remote URI) for this process, or None when the set fits
    ``--cache-bytes`` (then it is fetched whole: ``cache.local_folder``)."""
    cache = ShardCache(cfg.data_dir, cfg.cache_dir, cfg.cache_bytes)
    budget = cfg.cache_bytes if cfg.cache_bytes is not None else default_budget(_root(cache))
    if cache.set_bytes <= budget:
        return None
    raw = encoding(cache.manifest) == "raw"   # (the columns its source reads at open)
    return ShardStream(cache, budget, ["label"] if raw else ["label", "height", "width"])


def _root(cache: ShardCache) -> Path:
    cache.root.mkdir(parents=True, exist_ok=True)
    return cache.root


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


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
        self.root = _root(cache)
        self.key = cache.folder.name
        self.folder = self.root / f"{self.key}.s{os.getpid()}"
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
        self.fetched: list[str] = []
        self._fd: Optional[int] = None
        self._thread: Optional[threading.Thread] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._stop = False

    # ------------------------------------------------------------------ the source's side
    def handles(self, folder_split: str) -> list[StreamedShard]:
        return [self.shards[e["file"]] for e in self.manifest["splits"][folder_split]["shards"]]

    def share(self) -> int:
        """This process's share of the budget: divided among the streams of the set on the node."""
        streams = max(1, len(list(self.root.glob(f"{self.key}.s*"))))
        return self.budget // streams

    def need(self, files) -> int:
        return sum(self.sizes[f] for f in files)

    def _check_fits(self, files: frozenset) -> None:
        need, share = self.need(files), self.share()
        if need > share:
            streams = self.budget // max(1, share)
            raise DataError(
                f"--cache-bytes {self.budget}: one batch reads {len(files)} shards ({_size(need)}) of "
                f"--data-dir {self.uri}, more than this actor's share of the node's cache ({_size(share)}, "
                f"{streams} reading actor(s) on the node): raise --cache-bytes to at least "
                f"{need * streams}, or use --shuffle block (a batch then reads one window of "
                "--shuffle-window shards)")

    def announce(self, split: str, reads: list[frozenset]) -> None:
        """The reads of ``split`` to come, in order (each: the files it touches); they replace the
        split's earlier ones and go before the other splits'. Raises DataError for a read larger than
        this process's share (``_check_fits``)."""
        self._start()
        for files in reads:
            self._check_fits(files)
        with self.cond:
            self.plan = [_Read(split, f) for f in reads] + [r for r in self.plan if r.split != split]
            self.cond.notify_all()

    def foresee(self, split: str, reads: list[frozenset]) -> None:
        """The reads of ``split`` after those announced (the next epoch's, known from (seed, epoch)):
        they replace the split's earlier foreseen reads and follow its announced ones; they order the
        evictions and, with room left, the fetches."""
        for files in reads:
            self._check_fits(files)
        with self.cond:
            plan = [r for r in self.plan if not (r.split == split and r.ahead)]
            at = max((i + 1 for i, r in enumerate(plan) if r.split == split), default=0)
            self.plan = plan[:at] + [_Read(split, f, ahead=True) for f in reads] + plan[at:]
            self.cond.notify_all()

    @contextlib.contextmanager
    def read(self, split: str, files: frozenset) -> Iterator[dict[str, OpenShard]]:
        """Wait until ``files`` are on disk (this read made the plan's next one: the announced read
        it matches, else a read of its own), map them and yield {file: OpenShard}; at the end unmap
        those the next read does not touch."""
        self._start()
        self._check_fits(files)
        with self.cond:
            entry = next((r for r in self.plan if r.split == split), None)
            if entry is not None and entry.files == files:
                self.plan.remove(entry)
            else:
                entry = _Read(split, files)
            self.plan.insert(0, entry)
            for f in files:
                self.reading[f] = self.reading.get(f, 0) + 1
            self.cond.notify_all()
            try:
                while not files <= self.present:
                    if self.error is not None:
                        raise self.error
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
            self.cond.notify_all()

    # ------------------------------------------------------------------ the fetcher
    def _start(self) -> None:
        if self._thread is not None:
            return
        with _node_lock(self.lock_path):
            self.folder.mkdir(exist_ok=True)
            self._fd = os.open(self.folder, os.O_RDONLY)
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            for other in self.root.iterdir():   # (stale streams, other sets: removed where not in use)
                if other.is_dir() and other != self.folder:
                    _remove_if_free(other)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="rayconv-fetch")
        self._thread = threading.Thread(target=self._run, name="rayconv-stream", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the fetcher (the files stay until another stream of the node removes them; a later
        announcement or read starts it again)."""
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for sh in self.shards.values():
            sh.open = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._thread, self._pool, self._stop = None, None, False

    def used(self) -> int:
        """Bytes the node's cache holds now (every set's and stream's files, reservations included)."""
        return sum(p.stat().st_size for p in self.root.glob("*/*") if p.is_file())

    def _own(self) -> int:
        return self.need(self.present | self.flight)

    def _run(self) -> None:
        while not self._stop:
            with self.cond:
                if self.error is not None:
                    return
                try:
                    name = self._next_fetch()
                except BaseException as e:   # (a full disk, a failed eviction)
                    self.error = e
                    self.cond.notify_all()
                    return
                if name is None:
                    self.cond.wait(POLL_S)
                    continue
            self._pool.submit(self._fetch, name)

    def _next_fetch(self) -> Optional[str]:
        """The next file to fetch, its bytes reserved on disk (evicting by Belady's rule), or None."""
        nxt: dict[str, int] = {}
        for i, r in enumerate(self.plan):
            for f in r.files:
                nxt.setdefault(f, i)
        never = len(self.plan)
        with _node_lock(self.lock_path):
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
                text = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise StorageError(f"--data-dir {self.uri}: reading {name} failed ({text}): run again "
                                   "(or --resume)") from None
            if written != size or digest.hexdigest() != self.cache.entries[name]["sha256"]:
                raise DataError(f"--data-dir {self.uri}: {name} does not match its size and sha256 in "
                                f"manifest.json: run `python -m rayconv.prepare` again with --out {self.uri} "
                                "(it rewrites bad shards)")
            with self.cond:
                os.replace(tmp, self.folder / name)
                self.flight.discard(name)
                self.present.add(name)
                self.fetched.append(name)
                self.events.append(("fetch", name, self.used(), self.done, ()))
                self.cond.notify_all()
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            with self.cond:
                self.flight.discard(name)
                self.error = e
                self.cond.notify_all()


@contextlib.contextmanager
def _node_lock(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_if_free(folder: Path) -> None:
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

"""Prepared shards in object storage (``--data-dir s3://bucket/prefix``, ``gs://...``) read through a
node-local cache.

The readers (``shards.ShardSource``, ``raw_shards.RawShardSource``) memory-map local files; a remote
folder is first brought into a folder of the node's cache (``ShardCache.ready``), which the source then
reads as a local prepared folder. The cache folder is keyed by the URI and the manifest's sha256
(``<cache>/<sha256(uri)[:12]>-<sha256(manifest)[:16]>``), so a set is fetched once per node and reused
by every later run and epoch, and a set prepared again (a new manifest) gets a folder of its own.

What is fetched when: at the source's opening in each actor (the driver's checks read the manifest
alone: ``manifest_source.ManifestSource``), every shard the folder lacks, in the order the run first
reads them (``shard_order``: the shards of epoch 0's sample order, from the seed alone, then the val
shards), by ``THREADS`` threads (shards larger than ``2 * PART`` bytes in ``PART``-byte range reads).
Each shard is written to a temporary name, its size and sha256 checked against the manifest and renamed
over its name; the manifest is written last, so a folder whose fetch stopped part-way is completed by
the next opening, never read as complete. An exclusive ``flock`` on the set's lock file makes two
actors of one node fetch one after the other (the second finds the shards there); a process that reads
a set holds a shared ``flock`` on its folder, so that eviction (which takes both exclusively, without
waiting) never removes a folder in use.

``--cache-bytes`` bounds what the cache holds: before fetching, the folders of other sets are removed
(least recently used first, never one in use) until this set fits. A set larger than the budget is not
fetched whole: it streams (``shard_stream``: shards fetched ahead in the read order, evicted by furthest
next read); ``check_streams`` refuses in one line a budget that cannot hold one batch's shards, before Ray
starts where ``--cache-bytes`` is given (``data_dir.check_cache_bytes``, ``manifest_source``). Default:
half of what the cache's disk has free, with what the cache already holds. The sample order never
depends on the cache: the readers take the same rows of the same files as from a local folder.

``python -m rayconv.prepare DIR --out s3://...`` prepares into a local folder of the cache
(``staging_folder``, where a stopped prepare resumes) and then ``upload_prepared``: the manifest at the
URI removed, the shards put (an upload that fails is aborted), the manifest put last.

Errors: DataError (one line) for a shard that does not match its manifest; ``remote_manifest`` raises
StorageError (a missing bucket, an unreachable endpoint, wrong credentials) or DataError (no manifest).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayconv.data.shard_files import FORMATS
from rayconv.errors import DataError, first_line
from rayconv.files import atomic_write, cache_dir, node_lock
from rayconv.settings import DataSettings
from rayconv.storage import Location, StorageError, locate

MANIFEST = "manifest.json"   # rayconv.data.shard_files.MANIFEST
THREADS = 4                  # concurrent reads from the storage per fetch
PART = 8 << 20               # bytes per range read of a large shard
BUDGET_SHARE = 0.5           # the default --cache-bytes: this share of the disk's free bytes (and its own)

_HELD: dict[str, int] = {}   # cache folder -> fd holding its shared lock (this process reads it)


def remote_manifest(uri: str, flag: str = "--data-dir") -> tuple[Location, bytes, dict[str, Any]]:
    """(the folder's Location, its manifest's bytes, the manifest) of the prepared folder at ``uri``.
    Raises StorageError (one line) for a bucket that does not exist, an endpoint that does not answer or
    refuses the credentials; DataError for a folder without a manifest or one that does not read."""
    loc = locate(uri, flag=flag)
    try:
        data = (loc / MANIFEST).read_bytes()
    except FileNotFoundError:
        bucket = loc.path.split("/", 1)[0]
        if loc.remote and not _exists(loc.fs, bucket):
            raise StorageError(f"{flag} {uri}: the bucket {bucket} does not exist (or these credentials "
                               "cannot see it): check the URI and the storage's credentials") from None
        raise DataError(f"{flag} {uri} has no {MANIFEST}: give a folder written by python -m rayconv.prepare "
                        f"(prepare one there with `python -m rayconv.prepare DIR --out {uri}`)") from None
    except OSError as e:
        raise StorageError(f"{flag} {uri}: the storage cannot be read ({first_line(e)}): check the endpoint "
                           "(AWS_ENDPOINT_URL) and the credentials") from None
    try:
        manifest = json.loads(data)
        assert manifest.get("format") in FORMATS, f"format {manifest.get('format')!r}, not one of {FORMATS}"
        for split in manifest["splits"].values():
            for e in split["shards"]:
                assert {"file", "bytes", "sha256", "rows"} <= set(e), "a shard entry lacks a key"
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
        raise DataError(f"{flag} {uri}: its {MANIFEST} is not a rayconv shard manifest ({e}): prepare the "
                        "folder again") from None
    return loc, data, manifest


def _exists(fs: Any, path: str) -> bool:
    import pyarrow.fs as pafs
    try:
        return fs.get_file_info(path).type != pafs.FileType.NotFound
    except OSError:
        return True   # (an error other than absence is reported by the read that follows)


def shard_order(manifest: dict[str, Any], epoch_order: np.ndarray) -> list[str]:
    """The manifest's shard files in the order a run first reads them: the train shards by their first
    sample in ``epoch_order`` (epoch 0's sample order, ``data.order``: from the seed alone), then the
    val shards in order."""
    train = manifest["splits"]["train"]["shards"]
    shard_of = np.searchsorted(np.cumsum([int(e["rows"]) for e in train]), epoch_order, side="right")
    ids, first = np.unique(shard_of, return_index=True)
    val = [e["file"] for e in manifest["splits"]["val"]["shards"]]
    return [train[int(s)]["file"] for s in ids[np.argsort(first)]] + val


class ShardCache:
    """The node-local cache of one remote prepared folder (module docstring). ``root``: the cache's
    folder (``--cache-dir``, default ``files.cache_dir() / "shards"``); ``budget``: ``--cache-bytes``
    (None: the default share of the free disk)."""

    def __init__(self, uri: str, root: Optional[str] = None, budget: Optional[int] = None):
        self.uri = uri
        self.location, self.manifest_bytes, self.manifest = remote_manifest(uri)
        self.root = Path(root) if root else cache_dir() / "shards"
        digest = hashlib.sha256
        key = f"{digest(uri.encode()).hexdigest()[:12]}-{digest(self.manifest_bytes).hexdigest()[:16]}"
        self.folder = self.root / key
        self.entries = {e["file"]: e for split in self.manifest["splits"].values() for e in split["shards"]}
        self.set_bytes = sum(int(e["bytes"]) for e in self.entries.values()) + len(self.manifest_bytes)
        self.budget = budget
        self.fetched: list[str] = []     # files this opening fetched, in fetch order
        self.evicted: list[str] = []     # cache folders this opening removed

    def ready(self, order: Optional[list[str]] = None) -> Path:
        """The local folder holding the whole set, fetched now where missing (in ``order``, default
        the manifest's), other sets evicted to stay within the budget; this process keeps a shared lock
        on it. Raises DataError (too small a budget, a shard that does not match, a full disk) or
        StorageError (the storage failed while fetching)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"--cache-dir {self.root}: cannot make the folder ({e.strerror or e})") from None
        budget = self.budget if self.budget is not None else default_budget(self.root)
        self.check_fits(budget)
        with node_lock(self.root / f".{self.folder.name}.lock"):   # (one fetcher of this set per node)
            self.folder.mkdir(exist_ok=True)
            todo = [f for f in (order or list(self.entries)) if not self._complete(f)]
            todo += [f for f in self.entries if f not in todo and not self._complete(f)]
            manifest = self.folder / MANIFEST
            if todo or not manifest.is_file() or manifest.read_bytes() != self.manifest_bytes:
                manifest.unlink(missing_ok=True)   # (incomplete until every shard is back)
                self._make_room(budget)
                self._fetch(todo)
                atomic_write(self.folder / MANIFEST, lambda tmp: Path(tmp).write_bytes(self.manifest_bytes))
            os.utime(self.folder)   # (least recently used: the folder's mtime)
            self._hold()
        return self.folder

    # ------------------------------------------------------------------ budget
    def check_fits(self, budget: int) -> None:
        """Raise DataError (one line, saying what to change) when the set is larger than ``budget``
        bytes: the readers map every shard at open, so a node's cache holds the set whole."""
        if self.set_bytes > budget:
            raise DataError(f"--data-dir {self.uri} holds {_size(self.set_bytes)}, more than --cache-bytes "
                            f"{budget} ({_size(budget)}), and each node's cache holds the set whole: raise "
                            "--cache-bytes to at least the set (on a disk that has the room: --cache-dir), "
                            "or copy the set to every node's disk first (--stage-dir)")

    def check_streams(self, budget: int, window: Optional[tuple[int, int]] = None) -> None:
        """Raise DataError (one line, saying what to change) when a set larger than ``budget`` cannot
        stream through it either (``shard_stream``): its largest shard, or ``window`` = (bytes, shards)
        that one batch reads, is larger than ``budget``."""
        if self.set_bytes <= budget:
            return
        big = max((int(e["bytes"]) for e in self.entries.values()), default=0)
        need, shards = window if window is not None and window[0] > big else (big, 1)
        if need > budget:
            block = "" if window is None else ", use --shuffle block (a batch reads one window of shards)"
            raise DataError(f"--data-dir {self.uri} holds {_size(self.set_bytes)}, more than --cache-bytes "
                            f"{budget}, and streams through the cache only where it holds the {shards} "
                            f"shard(s) one batch reads ({_size(need)}): raise --cache-bytes to at least "
                            f"{need}{block}, or copy the set to every node's disk first (--stage-dir)")

    def used(self) -> int:
        """Bytes the cache's folders hold now (every set's)."""
        return sum(p.stat().st_size for p in self.root.glob("*/*") if p.is_file())

    def _make_room(self, budget: int) -> None:
        """Remove other sets' folders, least recently used first and none in use, until this set fits."""
        have = sum((self.folder / f).stat().st_size for f in self.entries if (self.folder / f).is_file())
        others = sorted((p for p in self.root.iterdir() if p.is_dir() and p != self.folder),
                        key=lambda p: p.stat().st_mtime)
        need = self.set_bytes - have
        for other in others:
            if self.used() + need <= budget:
                return
            with _try_exclusive(self.root / f".{other.name}.lock", other) as free:
                if free:
                    shutil.rmtree(other, ignore_errors=True)
                    self.evicted.append(other.name)
        if self.used() + need > budget:
            raise DataError(f"--cache-dir {self.root}: {_size(self.used())} held by sets in use, "
                            f"{_size(need)} more needed for {self.uri}: raise --cache-bytes or wait for the "
                            "other runs")

    # ------------------------------------------------------------------ fetching
    def _complete(self, name: str) -> bool:
        """Whether the cache holds ``name`` whole: a file under its name was checked before its rename,
        so its size alone tells it apart from another set's file (the folder is keyed by the manifest)."""
        p = self.folder / name
        return p.is_file() and p.stat().st_size == int(self.entries[name]["bytes"])

    def _fetch(self, names: list[str]) -> None:
        for p in self.folder.glob(".*.part"):   # (an earlier fetch that stopped)
            p.unlink(missing_ok=True)
        free = shutil.disk_usage(self.folder).free
        need = sum(int(self.entries[n]["bytes"]) for n in names)
        if need > free:
            raise DataError(f"--cache-dir {self.root}: {_size(need)} to fetch, {_size(free)} free on its "
                            "disk: free space there or give --cache-dir another disk")
        with ThreadPoolExecutor(THREADS) as pool:
            # Parts of every shard in the run's order, a few threads reading them: the first shards the
            # run reads are whole first.
            jobs = []
            for name in names:
                tmp = self.folder / f".{name}.part"
                size = int(self.entries[name]["bytes"])
                with open(tmp, "wb") as f:
                    f.truncate(size)
                parts = ([(o, min(PART, size - o)) for o in range(0, size, PART)] if size > 2 * PART
                         else [(0, size)])
                jobs.append((name, tmp, [pool.submit(self._read_part, name, tmp, o, n) for o, n in parts]))
            for name, tmp, parts in jobs:
                for part in parts:
                    part.result()
                self._finish(name, tmp)

    def _read_part(self, name: str, tmp: Path, offset: int, length: int) -> None:
        src = self.location / name
        try:
            with src.fs.open_input_file(src.path) as f:
                data = f.read_at(length, offset)
        except OSError as e:
            raise StorageError(f"--data-dir {self.uri}: reading {name} failed ({first_line(e)}); the shards "
                               "fetched so far stay in the cache: run again") from None
        if len(data) != length:
            raise DataError(f"--data-dir {self.uri}: {name} is shorter than its {MANIFEST} says: run "
                            f"`python -m rayconv.prepare` again with --out {self.uri}")
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def _finish(self, name: str, tmp: Path) -> None:
        """Check the fetched ``tmp`` against the manifest (size, sha256) and rename it over ``name``."""
        from rayconv.files import sha256_file
        entry = self.entries[name]
        if tmp.stat().st_size != int(entry["bytes"]) or sha256_file(tmp) != entry["sha256"]:
            tmp.unlink(missing_ok=True)
            raise self.mismatch(name)
        os.replace(tmp, self.folder / name)
        self.fetched.append(name)

    def mismatch(self, name: str) -> DataError:
        """The error for a fetched shard ``name`` whose size or sha256 is not the manifest's."""
        return DataError(f"--data-dir {self.uri}: {name} does not match its size and sha256 in "
                         f"{MANIFEST}: run `python -m rayconv.prepare` again with --out {self.uri} (it "
                         "rewrites bad shards)")

    # ------------------------------------------------------------------ in use
    def _hold(self) -> None:
        """A shared lock on the folder while this process reads it (ended by the process's end)."""
        if str(self.folder) in _HELD:
            return
        fd = os.open(self.folder, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _HELD[str(self.folder)] = fd


@contextlib.contextmanager
def _try_exclusive(lock: Path, folder: Path):
    """Yield whether ``folder`` is free to remove: its fetch ``lock`` and the folder itself (the shared
    lock of its readers) locked exclusively at once."""
    fds = []
    try:
        for path in (lock, folder):
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT if path == lock else os.O_RDONLY, 0o644))
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        yield False
    else:
        yield True
    finally:
        for fd in fds:
            os.close(fd)


def default_budget(root: Path) -> int:
    """``BUDGET_SHARE`` of ``root``'s free disk plus what the cache holds there already, in bytes."""
    held = sum(p.stat().st_size for p in root.glob("*/*") if p.is_file()) if root.is_dir() else 0
    return int(BUDGET_SHARE * (shutil.disk_usage(root if root.is_dir() else root.parent).free + held))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


size_text = _size   # ``n`` bytes in MiB or GiB, for other modules' messages


def local_folder(cfg: DataSettings, order=None) -> Optional[str]:
    """The local folder ``cfg.data_dir`` is read from: a plain path itself, a ``file://`` URI's path, a
    remote URI's cache folder made ready now (``ShardCache.ready``; ``order(manifest)``: the sample
    order of epoch 0, which orders the fetch); None without a data_dir."""
    from rayconv.storage import is_remote, is_uri
    where = cfg.data_dir
    if not where or not is_uri(where):
        return where
    if not is_remote(where):
        return str(locate(where, flag="--data-dir").local)
    started = time.perf_counter()
    cache = ShardCache(where, cfg.cache_dir, cfg.cache_bytes)
    folder = cache.ready(shard_order(cache.manifest, order(cache.manifest)) if order else None)
    LAST.update(fetched=list(cache.fetched), evicted=list(cache.evicted),
                seconds=time.perf_counter() - started, folder=str(folder))
    return str(folder)


LAST: dict[str, Any] = {}   # what this process's last ``local_folder`` of a remote set did (for reports)


def staging_folder(uri: str) -> Path:
    """Where ``python -m rayconv.prepare --out URI`` writes the shards before they go up: a folder of
    rayconv's cache keyed by the URI (a stopped prepare resumes there)."""
    return cache_dir() / "prepare" / hashlib.sha256(uri.encode()).hexdigest()[:16]


def upload_prepared(folder: Path, uri: str, log=print) -> None:
    """Put the prepared ``folder`` at ``uri``: its manifest there removed first, the shards uploaded
    (``THREADS`` at a time, each object one whole PUT), shards the manifest does not list removed, the
    manifest uploaded last, so that the folder at ``uri`` reads as complete only once all its shards are
    there; ``folder`` is removed after. Raises StorageError (one line) when the storage fails."""
    dest = locate(uri, flag="--out")
    manifest = json.loads((folder / MANIFEST).read_bytes())
    names = [e["file"] for split in manifest["splits"].values() for e in split["shards"]]

    def put(name: str) -> None:
        stream = dest.fs.open_output_stream((dest / name).path)
        try:
            with open(folder / name, "rb") as fi:
                shutil.copyfileobj(fi, stream, PART)
        except BaseException:
            if hasattr(stream, "abort"):   # (pyarrow >= 16: the upload dropped, no partial object made)
                stream.abort()
            raise
        stream.close()

    try:
        (dest / MANIFEST).delete()
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(put, names))
        for stale in set(dest.listdir()) - set(names) - {MANIFEST}:
            if stale.endswith((".arrow", ".parquet")):
                (dest / stale).delete()
        (dest / MANIFEST).write_bytes((folder / MANIFEST).read_bytes())
    except OSError as e:
        raise StorageError(f"--out {uri}: uploading the shards failed ({first_line(e)}); they stay in "
                           f"{folder}: run the same command again") from None
    log(f"prepare: {len(names)} shards and {MANIFEST} uploaded to {uri}")
    shutil.rmtree(folder, ignore_errors=True)


def release() -> None:
    """End this process's shared locks on the sets it read (they may then be evicted): a process that
    reads no set any longer (a test, a notebook between runs)."""
    while _HELD:
        os.close(_HELD.popitem()[1])

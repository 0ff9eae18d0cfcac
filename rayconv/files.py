"""Files that are never half-written: atomic replace, fsync of a file and its folder, sha256; and where
rayconv keeps what it caches across runs (``cache_dir``).

Every output (checkpoints, ``metrics.parquet``, ``summary.json``, ``model.pt``, shards) goes through
these, so an interrupted run leaves the previous complete file, never a partial one."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename over ``path`` (same folder, so the rename is atomic); a
    ``storage.Location`` in an object store uploads the file as one object (``Location.write_with``)."""
    if hasattr(path, "write_with"):
        path.write_with(write)
        return
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # as a plain open() would create it (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def folder_lock(folder: Path):
    """Hold an exclusive ``flock(2)`` on the folder itself (no file is added to it) while the block
    runs: a second holder, in this process or another on the same host, waits. Raises OSError."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def cache_dir() -> Path:
    """The folder of what rayconv keeps across runs (the planner's measurements, torchvision's model
    names): ``$RAYCONV_CACHE_DIR``, else ``~/.cache/rayconv``. Not made here."""
    return Path(os.environ.get("RAYCONV_CACHE_DIR") or Path.home() / ".cache" / "rayconv")


@contextlib.contextmanager
def node_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (made when missing) while the block runs: one
    process of the node at a time (the shard cache's fetcher, a stream's accounting)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

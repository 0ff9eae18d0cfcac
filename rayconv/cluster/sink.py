"""Checkpoint rank files to a local ``--out`` from actors on other nodes: a writer on the driver's node.

An ``--out`` that is a plain path (or ``file://``) is the driver node's disk. Actors on the driver's
node write their rank files there themselves; where an actor runs on another node, which may not see
that folder (no shared file system), its rank file goes to ``RankFileSink``, a Ray actor pinned to the
driver's node (``NodeAffinitySchedulingStrategy``, no CPU reserved), in ``PIECE_BYTES`` pieces with one
in flight, so neither side holds the whole rank file in memory; the sink writes each file to a temporary
name, fsyncs and renames it (whole or absent). ``needs_sink`` decides which actors use it (the driver's
console says which); a bucket is written by every actor directly.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import ray

PIECE_BYTES = 8 << 20


class RankFileSink:
    """The files being written through this node (``open`` / ``append`` / ``commit`` / ``abort``)."""

    def __init__(self) -> None:
        self.files: dict[int, tuple[Any, Path, Path]] = {}
        self.next = 0

    def open(self, path: str) -> int:
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}.tmp-sink")
        self.next += 1
        self.files[self.next] = (open(tmp, "wb"), tmp, final)
        return self.next

    def append(self, handle: int, data: bytes | bytearray) -> None:
        self.files[handle][0].write(data)

    def commit(self, handle: int) -> None:
        f, tmp, final = self.files.pop(handle)
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)

    def abort(self, handle: int) -> None:
        f, tmp, _ = self.files.pop(handle, (None, None, None))
        if f is not None:
            f.close()
            tmp.unlink(missing_ok=True)


class _PieceStream:
    """A write-only file that sends what is written to the sink in ``PIECE_BYTES`` pieces."""

    def __init__(self, sink: Any, handle: int):
        self.sink, self.handle, self.buf, self.sent = sink, handle, bytearray(), None

    def write(self, data) -> int:
        self.buf += data
        if len(self.buf) >= PIECE_BYTES:
            self._send()
        return len(data)

    def _send(self) -> None:
        if self.sent is not None:
            ray.get(self.sent)   # (one piece in flight)
        # (the piece itself, not a bytes copy of it: Ray serialises a bytearray out of band)
        self.sent = self.sink.append.remote(self.handle, self.buf)
        self.buf = bytearray()

    def close(self) -> None:
        if self.buf:
            self._send()
        if self.sent is not None:
            ray.get(self.sent)


@dataclass
class SinkFolder:
    """A folder on the driver's node written through ``sink`` (a ``RankFileSink`` handle); ``/`` names a
    file in it, whose ``stream()`` is what ``actor.saver.open_stream`` writes to."""

    sink: Any
    path: str

    def __truediv__(self, name: str) -> "SinkFolder":
        return SinkFolder(self.sink, f"{self.path.rstrip('/')}/{name}")

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return f"{self.path} (through the driver's node)"

    @contextmanager
    def stream(self) -> Iterator[Any]:
        handle = ray.get(self.sink.open.remote(self.path))
        out = _PieceStream(self.sink, handle)
        try:
            yield out
            out.close()
            ray.get(self.sink.commit.remote(handle))
        except BaseException:
            ray.get(self.sink.abort.remote(handle))
            raise


def needs_sink(local: bool, driver_node: str, actor_nodes: Sequence[Optional[str]]) -> list[bool]:
    """Which actors send their rank files through the driver's node: those on another node, where the
    checkpoint's place is ``local`` (a path on the driver's disk); none for a bucket."""
    return [local and node != driver_node for node in actor_nodes]


def start_sink(driver_node: str) -> Any:
    """A ``RankFileSink`` on the driver's node (no CPU reserved)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return ray.remote(num_cpus=0)(RankFileSink).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=False)).remote()

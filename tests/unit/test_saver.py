"""actor/saver.py's background writes: the writer thread at the lowest CPU priority (the step's thread
keeps its own), no torch operator run while a rank file is written, the bytes hashed as they are written
and equal to ``torch.save``'s, and each write's result handed over once, in order, when the next write
began before it was."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import threading
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rayconv.actor.saver import NICE, Saver, write_rank_file
from rayconv.storage import locate


def _payload() -> tuple[dict, dict]:
    header = {"format": 2, "skeleton": {"rank": 0, "model": {"w": "\0entry"}}, "own": []}
    return header, {"model/w": torch.arange(20_000, dtype=torch.float64), "model/b": torch.ones(3)}


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class Recording:
    """A file to write to through ``stream()`` (as ``cluster.sink.SinkFolder``'s files are): the bytes
    kept in memory, the writing thread's niceness noted."""

    name = "rank-0.pt"

    def __init__(self) -> None:
        self.data, self.nice = io.BytesIO(), None

    @contextmanager
    def stream(self):
        self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        yield self.data


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_writer_thread_runs_at_the_lowest_priority_and_the_callers_keeps_its_own():
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    header, tensors = _payload()
    where, saver = Recording(), Saver()
    saver.start(2, where, header, tensors)
    [result] = saver.wait()
    assert where.nice == NICE and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    data = where.data.getvalue()
    assert data == _saved({**header, "tensors": tensors})
    assert result["step"] == 2 and result["files"] == [
        {"name": "rank-0.pt", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}]


class Operators(TorchDispatchMode):
    """The torch operators called in this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.called: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.called.append(str(func))
        return func(*args, **(kwargs or {}))


def test_writing_a_rank_file_runs_no_torch_operator(tmp_path):
    """So that no intra-op thread pool is started for the writer thread (torch's pools are per calling
    thread): ``torch.save`` of host tensors only walks their storages."""
    header, tensors = _payload()
    with Operators() as ops:
        tensors["model/b"].add(1)   # (the record works: an operator is seen)
    assert ops.called == ["aten.add.Tensor"]
    with Operators() as ops:
        meta = write_rank_file(locate(tmp_path) / "rank-0.pt", {**header, "tensors": tensors})
    assert ops.called == []
    data = (tmp_path / "rank-0.pt").read_bytes()
    assert meta == {"name": "rank-0.pt", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert data == _saved({**header, "tensors": tensors})


class Held(Recording):
    """A file whose write waits until ``release`` is set (a slow storage), then goes on as Recording's."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    @contextmanager
    def stream(self):
        assert self.release.wait(30)
        with super().stream() as f:
            yield f


def test_a_result_is_kept_until_handed_over_when_the_next_write_begins_first():
    """The driver may begin a checkpoint before it has the previous one's result: ``start`` waits for the
    write under way and keeps its result, and each result is handed over once, oldest first."""
    header, tensors = _payload()
    saver, slow, fast = Saver(), Held(), Recording()
    saver.start(2, slow, header, tensors)
    assert saver.finished() == []   # (being written)
    threading.Timer(0.2, slow.release.set).start()
    saver.start(4, fast, header, tensors)   # (waits for step 2's write)
    got = saver.wait()
    assert [r["step"] for r in got] == [2, 4] and all("files" in r for r in got)
    assert saver.finished() == [] and saver.wait() == []
    assert slow.data.getvalue() == fast.data.getvalue() == _saved({**header, "tensors": tensors})

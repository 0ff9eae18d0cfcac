"""An actor's checkpoint writes, in the background: the rank file of a checkpoint it holds
(``state.checkpoint_rank_file``: copied to host memory at the step boundary) serialised with
``torch.save`` and streamed to its place while training continues, with its size and sha256 for the
driver's manifest.

Where a rank file goes: a ``storage.Location`` (a bucket, or a folder this node sees: written to a
temporary name and renamed, so whole or absent) or a ``cluster.sink.SinkFolder`` (a writer on the
driver's node, for a local ``--out`` that this node does not see). A write that fails is tried again
(``TRIES`` in all, ``RETRY_S`` apart, from the same host copy) and then reported as one line; a rank
file written halfway is never resumed, since only the driver's manifest, written once every rank file is
in, makes a checkpoint.
One write at a time: ``start`` waits for the one before, whose result it keeps until handed over
(the driver may begin the next checkpoint before it has the previous one's results).

What the write costs the step: the thread runs at the lowest CPU priority (``lowest_priority``: nice 19,
Linux's per-thread niceness), so that on a busy machine it takes the CPU the step leaves; it runs no
torch operator (``torch.save`` of host tensors only walks their storages), so no intra-op thread pool
is started for it; the bytes go from the host copies to the storage as ``torch.save`` hands them over,
hashed as they pass (no whole file in memory); a bucket is written through pyarrow's output stream,
whose I/O threads upload the parts (10 MB each) several at a time while this thread goes on handing
over bytes: at the rate of a checkpoint every few seconds the upload's rate decides whether the next
checkpoint waits for this one.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterator, Optional

import torch

TRIES = 3
RETRY_S = (0.5, 2.0)   # seconds before the second and third try
NICE = 19   # the writer thread's niceness: the lowest CPU priority


def lowest_priority() -> bool:
    """Put the calling thread (and threads it starts later) at the lowest CPU priority (nice ``NICE``):
    Linux gives each thread its own niceness; elsewhere (one niceness per process) nothing is changed.
    Returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except OSError:   # (a sandbox without setpriority: the thread keeps its priority)
        return False
    return True


class _Hashing:
    """A write-only file that counts and hashes what passes through to ``out``."""

    def __init__(self, out: BinaryIO):
        self.out, self.n, self.h = out, 0, hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data)
        self.h.update(view)
        self.out.write(view)
        self.n += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass


@contextmanager
def open_stream(where: Any) -> Iterator[BinaryIO]:
    """A stream to the file ``where`` (a ``Location``, or anything with a ``stream()`` context such as
    ``SinkFolder``'s files), made whole or absent where the storage allows it (a local file through a
    temporary name and a rename; an object by one upload)."""
    if hasattr(where, "stream"):
        with where.stream() as f:
            yield f
        return
    if where.local is not None:
        where.local.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.local.with_name(f"{where.local.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, where.local)
        finally:
            tmp.unlink(missing_ok=True)
        return
    stream = where.fs.open_output_stream(where.path)
    try:
        yield stream
    except BaseException:
        if hasattr(stream, "abort"):   # (pyarrow >= 16: the upload dropped, not completed half-written)
            stream.abort()
        raise
    stream.close()


def write_rank_file(where: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """``torch.save(obj)`` streamed to ``where``; returns {name, bytes, sha256}."""
    with open_stream(where) as f:
        out = _Hashing(f)
        torch.save(obj, out)
    return {"name": where.name, "bytes": out.n, "sha256": out.h.hexdigest()}


class Saver:
    """One rank file written at a time by a background thread; each write's result (``step`` and
    ``files`` [{name, bytes, sha256}], or ``step`` and ``error``, one line) is kept until it is handed
    over, once, by ``finished`` (polled with each step's metrics) or ``wait``, oldest first."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[dict[str, Any]] = None   # the running (or last) write's, set by its thread
        self._kept: list[dict[str, Any]] = []   # results of finished writes not handed over yet

    def start(self, step: int, where: Any, header: dict[str, Any], tensors: dict[str, torch.Tensor],
              copied: Any = None) -> None:
        """Write ``{**header, "tensors": tensors}`` to ``where`` in the background (after the CUDA
        event ``copied``, where the host copies were made asynchronously), once the write before it is
        done (its result kept)."""
        self._join(wait=True)

        def run() -> None:
            t0 = time.perf_counter()
            lowest_priority()
            if copied is not None:
                copied.synchronize()
            error = ""
            for i in range(TRIES):
                if i:
                    time.sleep(RETRY_S[min(i, len(RETRY_S)) - 1])
                try:
                    meta = write_rank_file(where, {**header, "tensors": tensors})
                    self._result = {"step": step, "files": [meta], "write_s": time.perf_counter() - t0}
                    return
                except Exception as e:  # noqa: BLE001 - reported in one line by the driver
                    text = str(e).strip()
                    error = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
            self._result = {"step": step, "error": f"{where} not written after {TRIES} tries ({error})"}

        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the write under way, if any; its result is kept for ``finished`` or ``wait``."""
        self._join(wait=True)

    def finished(self) -> list[dict[str, Any]]:
        """The results of the writes done and not handed over yet (none: []), oldest first."""
        self._join(wait=False)
        return self._hand_over()

    def wait(self) -> list[dict[str, Any]]:
        """As ``finished``, once the last write is done (waiting for it)."""
        self._join(wait=True)
        return self._hand_over()

    def _join(self, wait: bool) -> None:
        """The last write's result into the kept ones once it is done (``wait``: waiting for it)."""
        if self._thread is None or (not wait and self._thread.is_alive()):
            return
        self._thread.join()
        if self._result is not None:
            self._kept.append(self._result)
        self._thread, self._result = None, None

    def _hand_over(self) -> list[dict[str, Any]]:
        out, self._kept = self._kept, []
        return out

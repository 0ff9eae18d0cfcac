"""The reader process of a raw-pixel shard source: a batch's pixels, sample indices and labels gathered
by a process of its own into a ring of shared-memory buffers, which the actor copies to its device.

Why a process: reader threads in the actor's process hold its GIL for their Python between copies,
and every other thread of the actor (the step thread, which gives up the GIL around each device call
and on CPUs around each operation) then waits to take it back; a process has a GIL of its own, and the
step thread's part per batch is one request sent and one reply received (benchmarks/RESULTS.md,
"Small images", has the reader's rate beside a busy thread either way).

``ReaderProcess(splits, width, pin)`` starts ``python -m rayconv.data.raw_reader`` (numpy and pyarrow
only: no torch in it), which maps the same shard files read-only (the page cache is shared) and checks
them as the actor's ``OpenShard`` does. Per split, a ring of ``slots`` buffers in one shared file
(``ring``): slot k holds uint8 (capacity, width) pixels and int64 (2, capacity) words (sample indices,
labels); on a GPU the ring is page-locked in the actor's process (``cudaHostRegister``), so its device
copies are asynchronous. ``submit(split, idx, later)`` -> a request number; the slot it gets is written
again only after the device copies last made from it (``copied``) have finished, and the process works
through requests in the order sent, so a slot's writes never overtake each other. ``later``: the rows
whose pages the process asks of the kernel first (``madvise``), for a gather to come. ``result(n)`` ->
(slot, pixels (k, width), indices (k,), labels (k,)) of request ``n``, views into the ring; it raises
DataError or IndexError as the gather in the process did (a shard that changed, a sample outside the
split), and DataError when the process has ended. The process ends when the actor's end of its pipe
closes (the actor stopped, killed or not), or at ``close``.

Messages (``multiprocessing.connection.Connection``, pickled tuples): to the process ``("open", {split:
[(path, rows, identity), ...]})``, ``("ring", split, key, path, slots, capacity, width)``, ``("batch", n,
split, key, slot, idx, later)``, ``("drop", key)``; back ``("mapped", key)``, ``("done", n, kind, message)``.
"""

from __future__ import annotations

import mmap
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayconv.data.raw_gather import RowGather
from rayconv.data.shard_files import OpenShard
from rayconv.errors import DataError

CHECK_S = 0.5   # a shard's file is checked at most this often (seconds): a random batch touches every shard
START_S = 60.0  # seconds the process may take to map a ring before the actor gives up on it
REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every CUDA context of the process


def _layout(capacity: int, width: int) -> tuple[int, int]:
    """(bytes of one slot, offset of its words): pixels first, the int64 words 64-byte aligned after."""
    words_at = -(-capacity * width // 64) * 64
    return -(-(words_at + 16 * capacity) // 64) * 64, words_at


def _slots(base: Any, slots: int, capacity: int, width: int, int64: Any) -> tuple[list, list]:
    """The ring's views, the same in both processes: per slot its uint8 (capacity, width) pixels and
    its (2, capacity) ``int64`` words, from ``base``, the whole mapping as a flat uint8 torch tensor (the
    actor) or numpy array (the reader process)."""
    slot_bytes, words_at = _layout(capacity, width)
    pixels, words = [], []
    for k in range(slots):
        at = k * slot_bytes
        pixels.append(base[at:at + capacity * width].reshape(capacity, width))
        words.append(base[at + words_at:at + words_at + 16 * capacity].view(int64).reshape(2, capacity))
    return pixels, words


# ---------------------------------------------------------------------------------- the actor's side
class _Ring:
    """One split's ring: ``slots`` slot buffers in a shared file mapped here (and page-locked with
    ``pin``), the device copies last made from each slot (``copies``), the next slot to claim."""

    def __init__(self, key: int, slots: int, capacity: int, width: int, pin: bool):
        import torch

        self.key, self.slots, self.capacity, self.width = key, slots, capacity, width
        self.slot_bytes = _layout(capacity, width)[0]
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, self.path = tempfile.mkstemp(prefix="rayconv-ring-", dir=folder)
        try:
            os.ftruncate(fd, slots * self.slot_bytes)
            self.mm = mmap.mmap(fd, slots * self.slot_bytes)
        except OSError as e:
            os.close(fd)
            os.unlink(self.path)
            raise DataError(
                f"no shared memory for the raw reader's ring ({e}): free space in {folder}") from None
        os.close(fd)
        base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = False
        if pin:
            self.registered = int(torch.cuda.cudart().cudaHostRegister(base.data_ptr(), len(self.mm),
                                                                       REGISTER_PORTABLE)) == 0
        self.pixels, self.words = _slots(base, slots, capacity, width, torch.int64)
        self.base = base
        self.copies: list[Any] = [None] * slots
        self.k = 0

    def claim(self) -> int:
        """The next slot, once the device copies last made from it have finished (long done: the slot
        was copied ``slots`` batches ago)."""
        slot, self.k = self.k, (self.k + 1) % self.slots
        self._copied(slot)
        return slot

    def wait_copies(self) -> None:
        for slot in range(self.slots):
            self._copied(slot)

    def _copied(self, slot: int) -> None:
        """Wait for the device copies last made from ``slot``, if any."""
        done, self.copies[slot] = self.copies[slot], None
        if done is not None:
            done.synchronize()

    def close(self) -> None:
        """Unmap (after ``wait_copies``); a batch still referenced keeps the mapping until it is freed."""
        import torch

        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.registered = False
        self.pixels, self.words, self.base = [], [], None
        try:
            self.mm.close()
        except BufferError:
            pass   # (a tensor made from the ring is still alive: the mapping goes with it)


def _stop(proc: subprocess.Popen, conn: Connection) -> None:
    try:
        conn.close()   # (the process ends at the end of its pipe)
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()


class ReaderProcess:
    """A raw shard source's reader process (module docstring). ``splits``: split -> [(shard path,
    rows, the file's identity when the actor opened it), ...]; ``width``: bytes per image; ``pin``: page-lock
    the rings (GPU actors). Raises DataError when the process cannot start."""

    def __init__(self, splits: dict[str, list[tuple[str, int]]], width: int, pin: bool):
        self.width, self.pin = width, pin
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "rayconv.data.raw_reader", str(requests_r),
                                          str(replies_w)], pass_fds=(requests_r, replies_w), env=env,
                                         stdin=subprocess.DEVNULL)
        except OSError as e:
            for fd in (requests_r, requests_w, replies_r, replies_w):
                os.close(fd)
            raise DataError(f"the raw shards' reader process did not start ({e})") from None
        os.close(requests_r)
        os.close(replies_w)
        self.requests = Connection(requests_w, readable=False)
        self.replies = Connection(replies_r, writable=False)
        self._finalize = weakref.finalize(self, _stop, self.proc, self.requests)
        self.rings: dict[str, _Ring] = {}
        self.taken: dict[int, tuple[_Ring, int, int]] = {}   # request -> (ring, slot, rows)
        self.arrived: dict[int, tuple[Optional[str], Optional[str]]] = {}   # request -> (error kind, message)
        self.n, self.keys = 0, 0
        self._send(("open", splits))

    def _send(self, message: tuple) -> None:
        try:
            self.requests.send(message)
        except OSError:
            raise self._ended() from None

    def _ended(self) -> DataError:
        code = self.proc.poll()
        return DataError("the raw shards' reader process ended" +
                         (f" (exit status {code})" if code is not None else "") +
                         ": see the actor's log for its error, then run again (or --resume)")

    def _receive(self) -> tuple:
        try:
            return self.replies.recv()
        except (EOFError, OSError):
            raise self._ended() from None

    def ring(self, split: str, capacity: int, slots: int) -> _Ring:
        """``split``'s ring of ``slots`` buffers of at least ``capacity`` rows: the one made before, or
        a new one (after the old one's requests are done and its copies finished)."""
        old = self.rings.get(split)
        if old is not None and old.capacity >= capacity and old.slots == slots:
            return old
        if old is not None:
            for n, (ring, _, _) in list(self.taken.items()):
                if ring is old:
                    self._wait(n)
                    self.taken.pop(n)
                    self.arrived.pop(n, None)
            old.wait_copies()
            self._send(("drop", old.key))
            old.close()
        self.keys += 1
        ring = _Ring(self.keys, slots, capacity, self.width, self.pin)
        try:
            self._send(("ring", split, ring.key, ring.path, slots, capacity, self.width))
            deadline = time.monotonic() + START_S
            while True:
                if not self.replies.poll(max(0.0, deadline - time.monotonic())):
                    raise DataError(f"the raw shards' reader process did not map its ring in {START_S:.0f} s")
                reply = self._receive()
                if reply[0] == "mapped" and reply[1] == ring.key:
                    break
                if reply[0] == "done" and reply[1] in self.taken:
                    self.arrived[reply[1]] = reply[2:]
        finally:
            os.unlink(ring.path)   # (both processes have it mapped, or the run stops here)
        self.rings[split] = ring
        return ring

    def submit(self, split: str, idx: np.ndarray, later: Optional[np.ndarray] = None) -> int:
        """Request the gather of rows ``idx`` of ``split`` into its ring (made by ``ring``) -> request
        number; ``later``: rows whose pages to ask for first."""
        ring = self.rings[split]
        if len(idx) > ring.capacity:
            raise ValueError(f"a batch of {len(idx)} rows for a ring of {ring.capacity}")
        slot = ring.claim()
        self.n += 1
        self.taken[self.n] = (ring, slot, len(idx))
        self._send(("batch", self.n, split, ring.key, slot, idx, later))
        return self.n

    def _wait(self, n: int) -> tuple[Optional[str], Optional[str]]:
        while n not in self.arrived:
            reply = self._receive()
            if reply[1] in self.taken:   # (replies to forgotten requests are dropped)
                self.arrived[reply[1]] = reply[2:]
        return self.arrived.pop(n)

    def result(self, n: int):
        """(slot, pixels uint8 (k, width), sample indices int64 (k,), labels int64 (k,)) of request ``n``,
        views into its ring. Raises DataError / IndexError as the gather did."""
        kind, message = self._wait(n)
        ring, slot, rows = self.taken.pop(n)
        if kind is not None:
            raise (IndexError if kind == "IndexError" else DataError)(message)
        words = ring.words[slot]
        return slot, ring.pixels[slot][:rows], words[0, :rows], words[1, :rows]

    def forget(self, numbers) -> None:
        """Requests whose results will not be asked for (an announcement replaced): their replies are
        dropped as they come; their slots are written in order all the same."""
        for n in numbers:
            if n is not None:
                self.taken.pop(n, None)
                self.arrived.pop(n, None)

    def copied(self, split: str, slot: int) -> None:
        """The device copies from ``slot`` of ``split``'s ring are queued on the current stream: mark their
        end."""
        import torch

        ring = self.rings[split]
        if ring.registered:
            ev = torch.cuda.Event()
            ev.record()
            ring.copies[slot] = ev

    def close(self) -> None:
        """Stop the process and unmap the rings (after their device copies)."""
        for ring in self.rings.values():
            ring.wait_copies()
            ring.close()
        self.rings.clear()
        self._finalize()


# ---------------------------------------------------------------------------------- the process's side
class _Split:
    """A split's shards as the process reads them: mapped, their labels, one ``RowGather``."""

    def __init__(self, files: list[tuple[str, int, tuple]]):
        self.shards = [OpenShard(Path(p), rows) for p, rows, _ in files]
        for sh, (_, _, identity) in zip(self.shards, files):
            sh.identity = tuple(identity)   # (a file changed since the actor opened it is named as changed)
        labels = [sh.columns(["label"])["label"] for sh in self.shards]
        self.labels = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)
        self.gather = RowGather(self.shards)
        self.checked = np.full(len(self.shards), -np.inf)

    def read_ahead(self, idx: np.ndarray) -> None:
        for s, ranges in self.gather.file_ranges(idx):
            self.shards[s].will_need_ranges(ranges)

    def read(self, idx: np.ndarray, pixels: np.ndarray, words: np.ndarray) -> None:
        """Rows ``idx`` into ``pixels`` (len(idx), width) and their indices and labels into ``words``
        (2, len(idx)), after checking the shards they lie in (each at most every CHECK_S seconds)."""
        at, shard = self.gather.rows_at(idx)
        if len(shard) and time.monotonic() - self.checked[shard].min() >= CHECK_S:
            for s in np.unique(shard).tolist():
                sh = self.shards[s]
                sh.check(CHECK_S)
                self.checked[s] = sh.checked_at
        words[0] = idx
        words[1] = self.labels[idx]
        self.gather.copy_np(at, pixels)


def serve(requests: Connection, replies: Connection) -> None:
    """The process's loop: messages taken in order from a receiving thread (which keeps the pipe
    drained, so that the actor never blocks sending, and asks the kernel for ``later``'s pages at once)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    splits: dict[str, _Split] = {}

    def receive() -> None:
        try:
            while True:
                message = requests.recv()
                if message[0] == "batch" and message[6] is not None and message[2] in splits:
                    try:
                        splits[message[2]].read_ahead(message[6])
                    except (IndexError, OSError, ValueError):
                        pass   # (the gather names the problem)
                inbox.put(message)
        except (EOFError, OSError):
            inbox.put(("stop",))

    rings: dict[int, tuple[mmap.mmap, list, list]] = {}
    receiving = threading.Thread(target=receive, daemon=True)
    first = requests.recv()
    if first[0] != "open":
        return
    broken: dict[str, str] = {}   # split -> why its shards did not open here
    for split, files in first[1].items():
        try:
            splits[split] = _Split(files)
        except DataError as e:
            broken[split] = str(e)
    receiving.start()
    while True:
        message = inbox.get()
        op = message[0]
        if op == "stop":
            return
        if op == "ring":
            _, split, key, path, slots, capacity, width = message
            with open(path, "r+b") as f:
                mm = mmap.mmap(f.fileno(), slots * _layout(capacity, width)[0])
            rings[key] = (mm, *_slots(np.frombuffer(mm, dtype=np.uint8), slots, capacity, width, np.int64))
            replies.send(("mapped", key))
        elif op == "drop":
            rings.pop(message[1], None)   # (unmapped as the views go)
        elif op == "batch":
            _, n, split, key, slot, idx, _ = message
            _, pixels, words = rings[key]
            if split in broken:
                replies.send(("done", n, "DataError", broken[split]))
                continue
            try:
                splits[split].read(idx, pixels[slot][:len(idx)], words[slot][:, :len(idx)])
            except IndexError as e:
                replies.send(("done", n, "IndexError", str(e)))
            except (DataError, OSError, ValueError) as e:
                replies.send(("done", n, "DataError", str(e)))
            else:
                replies.send(("done", n, None, None))


def main(argv: list[str]) -> int:
    requests = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)
    try:
        serve(requests, replies)
    except (BrokenPipeError, EOFError):
        pass   # (the actor's end closed: it stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

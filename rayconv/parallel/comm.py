"""The torch.distributed calls of the training actors: process groups, point-to-point and collectives.

Every collective and point-to-point operation of rayconv's training code goes through here, except
those ``nn.SyncBatchNorm`` makes inside its own forward and backward (``--sync-batchnorm``); outside
the actors, the planner's link measurement (``planner/measure.py``, which meets through
``open_rendezvous`` and ``join_world`` too) and the bench's anchor (``bench/anchor.py``, under torchrun)
run process groups of their own.

Actors join one process group (NCCL on GPUs, gloo on CPU) and make one subgroup per mesh group
(torch requires every rank to create every subgroup, in the same order). Groups are passed
explicitly; nothing else uses the default group.

Every call here adds to this process's communication volume (``reset_volume``, ``volume``): the bytes
of the tensors it hands to torch.distributed as data. All-reduce and reduce-scatter count the whole
input tensor, all-gather this rank's own part, broadcast the tensor on the source rank only,
point-to-point its sends (a receive is the peer's send). The count is independent of the algorithm
the backend picks (a ring all-reduce moves about 2 (n-1)/n times the tensor over the wires); calls
with no group (a singleton group) move nothing and count nothing.

Legend: N batch, C channels, H, W height, width; ``x_NCHW`` is an activation.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rayconv.mesh import AXES, Mesh

_volume: dict[str, int] = {}


def reset_volume() -> None:
    """Start counting this process's communication volume from zero."""
    _volume.clear()


def volume() -> dict[str, int]:
    """Bytes handed to torch.distributed since ``reset_volume``, by operation (``all_reduce``,
    ``reduce_scatter``, ``all_gather``, ``broadcast``, ``send``); the module docstring defines them."""
    return dict(_volume)


def _count(op: str, *tensors: torch.Tensor) -> None:
    _volume[op] = _volume.get(op, 0) + sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Groups:
    """This rank's process groups along each mesh axis, plus the world (all actors)."""

    rank: int
    mesh: Mesh
    world: Optional[dist.ProcessGroup]
    axis: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)

    def size(self, axis: str) -> int:
        return len(self.ranks[axis])

    def index(self, axis: str) -> int:
        """This rank's position inside its group along ``axis``."""
        return self.ranks[axis].index(self.rank)


# The rendezvous this process opened and has not joined yet (its address, rank 0's store), or None: one
# at most, a new run's replacing an unjoined one.
_opened: Optional[tuple[str, dist.TCPStore]] = None


def open_rendezvous(host: str, timeout_s: float) -> str:
    """Open a process group's rendezvous in this process (rank 0's, on node address ``host``) and
    return its "host:port": a TCPStore listening on a port the OS picks (port 0), so no other process
    can take the port between its choice and its use. The store waits here for this process's
    ``join_world``; ``timeout_s`` bounds every wait on it."""
    global _opened
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    address = f"{host}:{store.port}"
    _opened = (address, store)
    return address


def join_world(master: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """Join the world process group of ``world_size`` ranks through the rendezvous at ``master``
    (``open_rendezvous``: opened in this process for rank 0, connected to for the others). Blocks until
    all have joined or ``timeout_s`` passes (then raises from torch.distributed)."""
    global _opened
    timeout = datetime.timedelta(seconds=timeout_s)
    if _opened is not None and _opened[0] == master:
        store, _opened = _opened[1], None
    else:
        host, port = master.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def init_process_groups(mesh: Mesh, rank: int, master: str, backend: str, timeout_s: float) -> Groups:
    """Join the world process group at ``master`` (``join_world``) and make every mesh subgroup.

    Called at once by all ``mesh.world_size`` actors; blocks until all have joined or ``timeout_s``
    passes (then raises RuntimeError from torch.distributed).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    join_world(master, rank, mesh.world_size, backend, timeout_s)
    groups = Groups(rank=rank, mesh=mesh, world=dist.group.WORLD)
    for axis in AXES:
        for ranks in mesh.groups(axis):
            # Every rank creates every group, in the same order; singleton groups are kept cheap.
            g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                groups.axis[axis], groups.ranks[axis] = g, ranks
    return groups


def destroy() -> None:
    """Leave the process groups and close an unjoined rendezvous of this process."""
    global _opened
    _opened = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, group: Optional[dist.ProcessGroup], async_op: bool = False):
    """In-place sum over ``group`` (no-op for a singleton group)."""
    if group is None:
        return None
    _count("all_reduce", t)
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """In-place maximum over ``group``, blocking (no-op for a singleton or missing group): the float16
    overflow flag every actor of the mesh must agree on."""
    if group is None or dist.get_world_size(group) == 1:
        return
    _count("all_reduce", t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def broadcast(t: torch.Tensor, src: int, group: Optional[dist.ProcessGroup]) -> None:
    """Broadcast ``t`` in place from global rank ``src`` to ``group``."""
    if group is not None:
        if dist.get_rank() == src:
            _count("broadcast", t)
        dist.broadcast(t, src=src, group=group)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[tuple[int, ...], torch.dtype, int]],
             device: torch.device, group: Optional[dist.ProcessGroup]) -> tuple[list[torch.Tensor], list]:
    """Post ``sends`` ((tensor, global destination rank) pairs) and ``recvs`` (``(shape, dtype, global
    source rank)``) as one batch, and wait for the receives.

    With NCCL the batch is one ``ncclGroupStart``/``ncclGroupEnd`` group (``dist.batch_isend_irecv``),
    so its operations progress together. This is what makes a pipeline schedule safe whatever the
    message size: 1F1B's steady state has each stage send to its neighbour while that neighbour
    sends back (stage s posts "send activation m+1, receive gradient m"; stage s+1 "send gradient m,
    receive activation m+1"). Posted one by one on the pair's single NCCL stream, each send can only
    finish once the peer's receive runs, and that receive is queued behind the peer's own send: it
    works only while NCCL buffers the message. (Megatron-LM's ``p2p_communication`` pairs them the
    same way. Unpaired, the pattern hangs once a message outgrows NCCL's buffers, which
    ``tests/gpu/nccl_crossing.py`` shows on two GPUs.)
    Operations to the same peer match the peer's in the order posted. Returns the received tensors
    (in the order of ``recvs``) and the work handles of the sends, which keep the sent tensors alive
    until waited.
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t, dst in sends]
    _count("send", *(t for t, _ in sends))
    bufs = []
    for shape, dtype, src in recvs:
        bufs.append(torch.empty(shape, dtype=dtype, device=device))
        ops.append(dist.P2POp(dist.irecv, bufs[-1], src, group))
    if not ops:
        return [], []
    works = dist.batch_isend_irecv(ops)
    if not recvs:
        return [], works
    if len(works) == len(ops):
        # One work per operation (gloo, or a single operation): wait for the receives only; a gloo
        # receive must not be waited twice.
        for w in works[len(sends):]:
            w.wait()
        return bufs, works[:len(sends)]
    for w in works:  # NCCL: one work for the whole group (waiting it again later is harmless)
        w.wait()
    return bufs, works


class Pending:
    """A collective in flight: ``wait()`` blocks until it has finished (on CUDA it
    makes the current stream wait for it) and returns its result. Wait once.

    While ``timing`` is on (``time_exchanges``), the time ``wait`` blocks, with the device synchronised
    before and after, is added to ``exposed_s()``: the part of the exchange no compute hid."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            if _timing["on"]:
                sync_device(_timing["device"])
                t = time.perf_counter()
                self.work.wait()
                sync_device(_timing["device"])
                _timing["exposed_s"] += time.perf_counter() - t
            else:
                self.work.wait()
            self.work = None
        return self.finish()


_timing: dict = {"on": False, "device": None, "exposed_s": 0.0}


def sync_device(device: Optional[torch.device]) -> None:
    """Wait for everything queued on ``device`` (CUDA; nothing to wait for on CPU or for None)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_exchanges(on: bool, device: Optional[torch.device] = None) -> None:
    """Time what the activation exchanges of filter split leave exposed (``exposed_s``), from zero.
    Synchronises the device around every wait: for profiled steps only."""
    _timing.update(on=on, device=device, exposed_s=0.0)


def exposed_s() -> float:
    """Seconds blocked waiting for activation exchanges since ``time_exchanges(True, ...)``."""
    return _timing["exposed_s"]


def all_gather_dim(t: torch.Tensor, dim: int, sizes: list[int],
                   group: Optional[dist.ProcessGroup]) -> Pending:
    """Launch the concatenation of each rank's ``t`` along ``dim`` (sizes along ``dim`` may differ by
    rank): a ``Pending`` whose ``wait()`` gives the result."""
    if group is None:
        return Pending(None, lambda: t)
    shape = list(t.shape)
    parts = []
    for s in sizes:
        shape[dim] = s
        parts.append(torch.empty(shape, dtype=t.dtype, device=t.device))
    _count("all_gather", t)
    work = dist.all_gather(parts, t.contiguous(), group=group, async_op=True)
    return Pending(work, lambda: torch.cat(parts, dim=dim))


def reduce_scatter_dim(t: torch.Tensor, dim: int, sizes: list[int], index: int,
                       group: Optional[dist.ProcessGroup]) -> Pending:
    """Launch the sum of ``t`` over ``group``, of which this rank keeps its slice along ``dim`` (rank
    ``index`` of ``sizes``): a ``Pending`` whose ``wait()`` gives the slice.

    gloo has no reduce-scatter, so on CPU this is an all-reduce followed by a slice.
    """
    if group is None:
        return Pending(None, lambda: t)
    t = t.contiguous()
    _count("reduce_scatter", t)
    start = sum(sizes[:index])
    if dist.get_backend(group) == "nccl" and len(set(sizes)) == 1:
        # NCCL reduce-scatters along dim 0: move ``dim`` there and back (half the traffic of all-reduce).
        t0 = t.movedim(dim, 0).contiguous()
        out = torch.empty_like(t0.narrow(0, 0, sizes[index]))
        work = dist.reduce_scatter_tensor(out, t0, group=group, async_op=True)

        def finish():
            return out.movedim(0, dim).contiguous()
    else:
        t = t.clone()
        work = dist.all_reduce(t, group=group, async_op=True)

        def finish():
            return t.narrow(dim, start, sizes[index]).contiguous()
    return Pending(work, finish)

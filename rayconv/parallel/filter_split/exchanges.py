"""The exchanges of filter split (Krizhevsky et al. 2012, section 3.2): collectives along the split
dimension as autograd functions, and the gather overlapped with the layer that consumes it.

An activation is either *sliced* (actor f holds slice f of dim 1, or of dim 0 for the per-layer
plan's batch gather) or *replicated*. ``Gather`` turns sliced into replicated (forward all-gather,
backward reduce-scatter of the partial input gradients, or the own slice of an identical gradient);
``Scatter`` the reverse (keep the own slice; backward all-gather). ``BatchGather`` is Krizhevsky 2014's
switch from data to model parallelism (the batch gathered along dim 0). ``overlapped_gather`` cuts the
batch into pieces so that piece i + 1's all-gather runs while the layer computes piece i.
Every collective goes through ``rayconv.parallel.comm``.

Legend: N batch, C channels, H, W height, width; ``x_NCHW`` an activation; ``sizes`` the per-actor
extents of the split dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from rayconv.mesh import split_sizes
from rayconv.parallel import comm


def _start_padded_all_gather(x: torch.Tensor, dim: int, sizes: list[int], group) -> comm.Pending:
    """all-gather along ``dim`` where actor i holds ``sizes[i]`` (padded to the largest, then trimmed),
    launched: a ``comm.Pending`` whose ``wait()`` gives the result."""
    top = max(sizes)
    if x.shape[dim] < top:
        pad_shape = list(x.shape)
        pad_shape[dim] = top - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    pending = comm.all_gather_dim(x, dim, [top] * len(sizes), group)
    if all(s == top for s in sizes):
        return pending

    def trim():
        full = pending.finish()
        return torch.cat([full.narrow(dim, i * top, s) for i, s in enumerate(sizes)], dim=dim)
    return comm.Pending(pending.work, trim)


def _padded_all_gather(x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """all-gather along ``dim`` where actor i holds ``sizes[i]`` (padded to the largest, then trimmed)."""
    return _start_padded_all_gather(x, dim, sizes, group).wait()


class _Gather(torch.autograd.Function):
    """sliced -> replicated along ``dim``. Backward: sum over actors then own slice (``split_consumer``),
    or own slice of the (identical) full gradient (replicated consumer, e.g. the loss)."""

    @staticmethod
    def forward(ctx, x, dim, sizes, index, group, split_consumer):
        ctx.dim, ctx.sizes, ctx.index, ctx.group, ctx.split_consumer = (
            dim,
            sizes,
            index,
            group,
            split_consumer,
        )
        return _padded_all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, g):
        start = sum(ctx.sizes[:ctx.index])
        if ctx.split_consumer:
            g = comm.reduce_scatter_dim(g, ctx.dim, ctx.sizes, ctx.index, ctx.group).wait()
        else:
            g = g.narrow(ctx.dim, start, ctx.sizes[ctx.index]).contiguous()
        return g, None, None, None, None, None


class _Scatter(torch.autograd.Function):
    """replicated -> sliced along ``dim`` (keep own slice). Backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x, dim, sizes, index, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return x.narrow(dim, sum(sizes[:index]), sizes[index]).contiguous()

    @staticmethod
    def backward(ctx, g):
        return _padded_all_gather(g.contiguous(), ctx.dim, ctx.sizes, ctx.group), None, None, None, None


class Gather(nn.Module):
    """Module form of the channel (or unit) gather; ``sizes`` along ``dim`` per actor."""

    def __init__(self, dim: int, sizes: list[int], index: int, group, split_consumer: bool):
        super().__init__()
        self.dim, self.sizes, self.index, self.group, self.split_consumer = (
            dim,
            sizes,
            index,
            group,
            split_consumer,
        )

    def forward(self, x):
        return _Gather.apply(x, self.dim, self.sizes, self.index, self.group, self.split_consumer)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, sizes={self.sizes}, split_consumer={self.split_consumer}"


class Scatter(nn.Module):
    def __init__(self, dim: int, sizes: list[int], index: int, group):
        super().__init__()
        self.dim, self.sizes, self.index, self.group = dim, sizes, index, group

    def forward(self, x):
        return _Scatter.apply(x, self.dim, self.sizes, self.index, self.group)


class BatchGather(nn.Module):
    """Krizhevsky 2014's switch from data to model parallelism: gather every actor's replica batch
    (dim 0, sizes set per micro-batch by the worker in ``sizes``); backward reduce-scatters the partial
    gradients to each actor's own replica batch."""

    def __init__(self, index: int, group):
        super().__init__()
        self.index, self.group = index, group
        self.sizes: list[int] = []

    def forward(self, x):
        return _Gather.apply(x, 0, list(self.sizes), self.index, self.group, True)



@dataclass
class ExchangeSpec:
    """The channel gather in front of a dense layer, done in ``chunks`` pieces along the batch:
    ``sizes`` the actors' channel (or unit) extents along ``dim``, ``index`` this actor's."""

    dim: int
    sizes: list[int]
    index: int
    group: Optional[dist.ProcessGroup]
    chunks: int


class _InFlight:
    """One batch piece's exchange between ``_Launch`` and ``_Land``: forward its all-gather, backward
    the reduce-scatter of its input gradient."""

    def __init__(self, spec: ExchangeSpec):
        self.spec = spec
        self.pending: Optional[comm.Pending] = None


class _Launch(torch.autograd.Function):
    """Start piece's all-gather; output an empty token that ``_Land`` consumes. Backward (after
    ``_Land``'s backward started the reduce-scatter, and after later work autograd runs first): wait
    for the reduce-scatter and return this actor's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        flight.pending = _start_padded_all_gather(x, flight.spec.dim, flight.spec.sizes, flight.spec.group)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        g = ctx.flight.pending.wait()
        ctx.flight.pending = None
        return g, None


class _Land(torch.autograd.Function):
    """Wait for the piece's all-gather and return the full activation. Backward: start the
    reduce-scatter of the partial input gradient (every actor's filters contribute a part)."""

    @staticmethod
    def forward(ctx, token, flight):
        ctx.flight = flight
        full = flight.pending.wait()
        flight.pending = None
        return full

    @staticmethod
    def backward(ctx, g):
        spec = ctx.flight.spec
        ctx.flight.pending = comm.reduce_scatter_dim(g, spec.dim, spec.sizes, spec.index, spec.group)
        return g.new_empty(0), None


def overlapped_gather(x: torch.Tensor, spec: ExchangeSpec, layer) -> torch.Tensor:
    """``layer(gather(x))`` for a channel-sliced ``x_NC...`` with the gather overlapped with the layer.

    The batch is cut into ``spec.chunks`` pieces (at most N); piece i + 1's all-gather runs while
    ``layer`` computes piece i (the collective runs on the backend's own stream with NCCL, its own
    thread with gloo). Backward mirrors it: autograd runs later nodes first, so piece i's input
    gradient is reduce-scattered while piece i - 1's layer backward computes. This is the chunked
    overlap of tensor-parallel communication with computation (Wang et al., "Overlap Communication with
    Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS 2023, which cuts
    along the operands; here the cut is the batch), applied to Krizhevsky et al.'s filter split.
    ``layer`` must treat samples independently (a convolution or a fully connected layer). Results equal the
    unchunked gather's up to float rounding (the layer's weight gradient is summed over pieces). Returns
    ``layer``'s output for the whole batch."""
    n = x.shape[0]
    pieces = x.split(split_sizes(n, max(1, min(spec.chunks, n))), dim=0)
    flights = [_InFlight(spec) for _ in pieces]
    tokens = [_Launch.apply(pieces[0], flights[0])]
    outs = []
    for i in range(len(pieces)):
        if i + 1 < len(pieces):
            tokens.append(_Launch.apply(pieces[i + 1], flights[i + 1]))
        outs.append(layer(_Land.apply(tokens[i], flights[i])))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

"""Filter split (model parallelism by filters; Krizhevsky et al. 2012, section 3.2; Yadan et al. 2013,
section 3.2; today's tensor parallelism) and Krizhevsky 2014's per-layer plan.

Filter split over ``F`` actors: every convolution's filters (output channels) and every fully
connected layer's units are divided among the actors, sizes as even as possible. An activation is
either *sharded* (actor f holds channel slice f, along dim 1) or *replicated* (every actor holds all
of it). Per-channel layers (batch norm, activations, pooling, dropout, flatten) run on the shard.
A layer that needs every input channel (a dense conv or a linear layer) is preceded by a gather:
forward all-gather of the channel slices, backward reduce-scatter of the partial input gradients
(each actor's filters contribute a part). A grouped convolution whose groups line up with the shards
needs no exchange: that is Krizhevsky's two-column pattern, where only some layers connect across
columns (give the single-device model ``groups=2`` in those layers). The last layer's output is
gathered for the loss, which every actor then computes identically (backward: keep one's slice).
Batch norm over a channel shard is exact: its statistics are per channel.

Krizhevsky 2014 ("One weird trick", section 4): convolutional layers data parallel over all N
actors, then the batch is gathered (each actor gets all N shards' features) and the fully connected
layers are filter-split over the same N actors. Backward: the partial feature gradients are
reduce-scattered back to each actor's own batch shard. Conv weights are all-reduced over the N
actors; FC weights are not (each actor saw the whole batch for its units).

Legend: N batch, C channels, H, W height, width; ``x_NCHW`` an activation; ``sizes`` the per-actor
extents of the split dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from rayconv.mesh import split_sizes
from rayconv.parallel import comm
from rayconv.errors import PlanError

ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Hardswish, nn.ELU,
               nn.Dropout, nn.Identity)
PER_CHANNEL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.BatchNorm2d,
               nn.BatchNorm1d)


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
    """sharded -> replicated along ``dim``. Backward: sum over actors then own slice (``split_consumer``),
    or own slice of the (identical) full gradient (replicated consumer, e.g. the loss)."""

    @staticmethod
    def forward(ctx, x, dim, sizes, index, group, split_consumer):
        ctx.dim, ctx.sizes, ctx.index, ctx.group, ctx.split_consumer = dim, sizes, index, group, split_consumer
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
    """replicated -> sharded along ``dim`` (keep own slice). Backward: all-gather the slices' gradients."""

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
        self.dim, self.sizes, self.index, self.group, self.split_consumer = dim, sizes, index, group, split_consumer

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
    """Krizhevsky 2014's switch from data to model parallelism: gather every actor's batch shard
    (dim 0, sizes set per micro-batch by the worker in ``sizes``); backward reduce-scatters the partial
    gradients to each actor's own shard."""

    def __init__(self, index: int, group):
        super().__init__()
        self.index, self.group = index, group
        self.sizes: list[int] = []

    def forward(self, x):
        return _Gather.apply(x, 0, list(self.sizes), self.index, self.group, True)


class ShardedDropout(nn.Module):
    """Dropout on a channel (or unit) shard: the mask is drawn for the whole activation, from a
    generator that every actor of the split seeds alike each step (``reseed``), and each actor keeps
    its slice, so the shards together drop exactly what one device would draw for the full tensor
    (independent units, not the same mask repeated in every shard). Successive micro-batches of a
    step continue the generator's stream."""

    def __init__(self, p: float, sizes: list[int], index: int):
        super().__init__()
        self.p, self.sizes, self.index = p, sizes, index
        self.generator: Optional[torch.Generator] = None

    def reseed(self, seed: int, device: torch.device) -> None:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        if self.generator is None:
            raise RuntimeError("ShardedDropout.reseed must be called before training")
        full = list(x.shape)
        full[1] = sum(self.sizes)
        keep = torch.rand(full, generator=self.generator, device=x.device) >= self.p
        keep = keep.narrow(1, sum(self.sizes[:self.index]), self.sizes[self.index])
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, sizes={self.sizes}"


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
    """``layer(gather(x))`` for a channel-sharded ``x_NC...`` with the gather overlapped with the layer.

    The batch is cut into ``spec.chunks`` pieces (at most N); piece i + 1's all-gather runs while
    ``layer`` computes piece i (the collective runs on the backend's own stream with NCCL, its own
    thread with gloo). Backward mirrors it: autograd runs later nodes first, so piece i's input
    gradient is reduce-scattered while piece i - 1's layer backward computes. This is the chunked
    overlap of tensor-parallel communication with computation (Wang et al., "Overlap Communication with
    Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS 2023, which cuts
    along the operands; here the cut is the batch), applied to Krizhevsky et al.'s filter split.
    ``layer`` must treat samples independently (a convolution or a fully connected layer). Results equal the unchunked gather's up to float rounding (the layer's weight
    gradient is summed over pieces). Returns ``layer``'s output for the whole batch."""
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


class GatheredConv2d(nn.Conv2d):
    """A filter-split convolution that needs every input channel, with the gather of its channel-sharded
    input overlapped with its own compute (``overlapped_gather``). Parameters and state_dict are those of
    ``nn.Conv2d`` (this actor's filters)."""

    exchange: ExchangeSpec

    def forward(self, x):
        return overlapped_gather(x, self.exchange, lambda full: self._conv_forward(full, self.weight, self.bias))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_chunks={self.exchange.chunks}"


class GatheredLinear(nn.Linear):
    """``GatheredConv2d``'s fully connected counterpart (input ``x_NF`` sharded along F)."""

    exchange: ExchangeSpec

    def forward(self, x):
        return overlapped_gather(x, self.exchange, lambda full: nn.functional.linear(full, self.weight, self.bias))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_chunks={self.exchange.chunks}"


COMM_MODULES = (Gather, Scatter, BatchGather, GatheredConv2d, GatheredLinear)


@dataclass
class ShardedPart:
    """One actor's runnable part: ``modules`` in order, ``names[i]`` the model layer name of
    ``modules[i]`` (None for exchanges), ``split_dims`` state_dict keys cut by the split (key -> dim),
    ``synced`` the modules whose parameters are all-reduced (and whose parameters and buffers are
    broadcast) over the data-parallel group, ``out_sizes`` the shard
    sizes of the part's output along dim 1 (None when replicated)."""

    modules: list[nn.Module] = field(default_factory=list)
    names: list[Optional[str]] = field(default_factory=list)
    split_dims: dict[str, int] = field(default_factory=dict)
    synced: list[nn.Module] = field(default_factory=list)
    out_sizes: Optional[list[int]] = None
    batch_gather: Optional[BatchGather] = None


def _slice_param(p: Optional[torch.Tensor], start: int, size: int) -> Optional[nn.Parameter]:
    if p is None:
        return None
    return nn.Parameter(p.detach().narrow(0, start, size).clone(), requires_grad=p.requires_grad)


def _shard_module(name: str, m: nn.Module, sizes_out: list[int], index: int, in_local: int,
                  part: ShardedPart, exchange: Optional[ExchangeSpec] = None) -> nn.Module:
    """This actor's slice of conv/linear/bn ``m`` (output dimension), registering split keys; with
    ``exchange``, the layer gathers its own input, overlapped (``GatheredConv2d``, ``GatheredLinear``)."""
    start, size = sum(sizes_out[:index]), sizes_out[index]
    prefix = f"{name}." if name else ""
    if isinstance(m, nn.Conv2d):
        groups = m.groups if in_local == m.in_channels else m.groups // len(sizes_out)
        new: nn.Module = (GatheredConv2d if exchange else nn.Conv2d)(
            in_local, size, m.kernel_size, m.stride, m.padding, m.dilation, groups, m.bias is not None, m.padding_mode)
    elif isinstance(m, nn.Linear):
        new = (GatheredLinear if exchange else nn.Linear)(m.in_features, size, m.bias is not None)
    else:  # batch norm
        new = type(m)(size, m.eps, m.momentum, m.affine, m.track_running_stats)
        if m.track_running_stats:
            new.running_mean.copy_(m.running_mean.narrow(0, start, size))
            new.running_var.copy_(m.running_var.narrow(0, start, size))
            new.num_batches_tracked.copy_(m.num_batches_tracked)
            part.split_dims[prefix + "running_mean"] = part.split_dims[prefix + "running_var"] = 0
    if exchange is not None:
        new.exchange = exchange
    for pname in ("weight", "bias"):
        p = getattr(m, pname, None)
        if p is not None:
            setattr(new, pname, _slice_param(p, start, size))
            part.split_dims[prefix + pname] = 0
    return new.to(dtype=next(m.parameters()).dtype) if any(True for _ in m.parameters()) else new


def shard_layers(layers: list[tuple[str, nn.Module]], in_shape: tuple[int, ...], out_shapes: list[tuple[int, ...]],
                 in_sizes: Optional[list[int]], index: int, size: int, group: Optional[dist.ProcessGroup],
                 is_last: bool, exchange_chunks: int = 1) -> ShardedPart:
    """Filter-split ``layers`` over ``size`` actors; this is actor ``index``'s part.

    ``exchange_chunks`` > 1: each gather in front of a dense layer is done in that many batch pieces,
    overlapped with the layer (``overlapped_gather``); 1: one blocking ``Gather`` module.

    ``in_shape`` / ``out_shapes``: per-sample shapes of the part's input and each layer's output
    (from the plan). ``in_sizes``: shard sizes of the input along dim 1, None if replicated.
    Raises PlanError for a layer that cannot be split (with what to change).
    """
    part = ShardedPart()
    sizes = in_sizes
    shape = in_shape
    for (name, m), out_shape in zip(layers, out_shapes):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            cout = m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
            if cout < size:
                raise PlanError(f"splitting over {size} actors (--fs, or --dp under --plan) exceeds layer {name}'s "
                                f"{cout} output channels: use at most {cout}")
            sizes_out = split_sizes(cout, size)
            groups = getattr(m, "groups", 1)
            cin = m.in_channels if isinstance(m, nn.Conv2d) else m.in_features
            aligned = groups > 1 and groups % size == 0 and cin % size == 0 and cout % size == 0
            if aligned:
                # Column-local grouped conv: take (or keep) this actor's input channel slice.
                want = split_sizes(cin, size)
                if sizes is None:
                    part.modules.append(Scatter(1, want, index, group))
                    part.names.append(None)
                elif sizes != want:
                    raise PlanError(f"layer {name} (groups={groups}) does not line up with the channel shards "
                                    f"{sizes}: use an --fs that divides its groups")
                in_local = want[index]
            else:
                if groups > 1:
                    raise PlanError(f"layer {name} has groups={groups}, which --fs {size} does not divide: "
                                    f"choose --fs dividing {groups}")
                exchange = None
                if sizes is not None and exchange_chunks > 1:
                    exchange = ExchangeSpec(1, sizes, index, group, exchange_chunks)
                elif sizes is not None:
                    part.modules.append(Gather(1, sizes, index, group, split_consumer=True))
                    part.names.append(None)
                in_local = cin
            part.modules.append(_shard_module(name, m, sizes_out, index, in_local, part, exchange))
            part.names.append(name)
            sizes = sizes_out
        elif isinstance(m, PER_CHANNEL) or isinstance(m, ELEMENTWISE):
            if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)) and sizes is not None:
                m = _shard_module(name, m, sizes, index, 0, part)
            elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)):
                raise PlanError(f"batch norm {name} on a replicated activation cannot be split")
            elif isinstance(m, nn.Dropout) and sizes is not None:
                m = ShardedDropout(m.p, sizes, index)
            part.modules.append(m)
            part.names.append(name)
        elif isinstance(m, nn.Flatten) and m.start_dim == 1:
            if sizes is not None:
                spatial = math.prod(shape[1:])
                sizes = [s * spatial for s in sizes]
            part.modules.append(m)
            part.names.append(name)
        else:
            raise PlanError(f"filter split cannot divide layer {name or '<model>'} ({type(m).__name__}): "
                            "it supports Conv2d, Linear, BatchNorm, pooling, activations, dropout and flatten "
                            "(AlexNet, VGG, convnet); use --fs 1 for this model")
        shape = out_shape
    if is_last and sizes is not None:
        part.modules.append(Gather(1, sizes, index, group, split_consumer=False))
        part.names.append(None)
        sizes = None
    part.synced = list(part.modules)
    part.out_sizes = sizes
    return part


def krizhevsky2014(layers: list[tuple[str, nn.Module]], in_shape: tuple[int, ...],
                   out_shapes: list[tuple[int, ...]], index: int, size: int,
                   group: Optional[dist.ProcessGroup]) -> ShardedPart:
    """Conv layers data parallel, FC layers filter-split over the same ``size`` actors, the batch
    gathered before the first fully connected layer. Raises PlanError without a Linear layer."""
    first_fc = next((i for i, (_, m) in enumerate(layers) if isinstance(m, nn.Linear)), None)
    if first_fc is None:
        raise PlanError("--plan krizhevsky2014 needs fully connected (Linear) layers to split: use --dp only")
    part = ShardedPart()
    for name, m in layers[:first_fc]:
        part.modules.append(m)
        part.names.append(name)
    part.synced = list(part.modules)
    part.batch_gather = BatchGather(index, group)
    part.modules.append(part.batch_gather)
    part.names.append(None)
    shape = out_shapes[first_fc - 1] if first_fc > 0 else in_shape
    fc = shard_layers(layers[first_fc:], shape, out_shapes[first_fc:], None, index, size, group, is_last=True)
    part.modules += fc.modules
    part.names += fc.names
    part.split_dims = fc.split_dims
    return part


def whole_part(layers: list[tuple[str, nn.Module]]) -> ShardedPart:
    """No split: the layers as they are, every parameter synced over data parallel."""
    mods = [m for _, m in layers]
    return ShardedPart(modules=mods, names=[n for n, _ in layers],
                       synced=list(mods))

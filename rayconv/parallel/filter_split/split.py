"""Filter split of a run of layers (Krizhevsky et al. 2012, section 3.2; Yadan et al. 2013, section 3.2;
today's tensor parallelism): which layers an actor runs, and where the exchanges go.

Over ``F`` actors, every convolution's filters (output channels) and every fully connected layer's
units are divided among the actors, sizes as even as possible (``mesh.split_sizes``). Per-channel
layers (batch norm, activations, pooling, dropout, flatten) run on the slice. A layer that needs every
input channel (a dense conv or a linear layer) is preceded by a gather (``exchanges.Gather``, or its
own overlapped gather: ``layers.GatheredConv2d``). A grouped convolution whose groups line up with the
slices needs no exchange: that is Krizhevsky's two-column pattern, where only some layers connect across
columns (give the single-device model ``groups=2`` in those layers). The last layer's output is
gathered for the loss, which every actor then computes identically (backward: keep one's slice).
Batch norm over a channel slice is exact: its statistics are per channel.

Legend: N batch, C channels, H, W height, width; ``sizes`` the per-actor extents of dim 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from rayconv.errors import LayoutError
from rayconv.mesh import split_sizes
from rayconv.parallel.filter_split.exchanges import BatchGather, ExchangeSpec, Gather, Scatter
from rayconv.parallel.filter_split.layers import GatheredConv2d, GatheredLinear, SlicedDropout


ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Hardswish, nn.ELU,
               nn.Dropout, nn.Identity)
PER_CHANNEL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.BatchNorm2d,
               nn.BatchNorm1d)


@dataclass
class SlicedPart:
    """One actor's runnable part: ``modules`` in order, ``names[i]`` the model layer name of
    ``modules[i]`` (None for exchanges), ``split_dims`` state_dict keys cut by the split (key -> dim),
    ``synced`` the modules whose parameters are all-reduced (and whose parameters and buffers are
    broadcast) over the data-parallel group, ``out_sizes`` the slice
    sizes of the part's output along dim 1 (None when replicated)."""

    modules: list[nn.Module] = field(default_factory=list)
    names: list[Optional[str]] = field(default_factory=list)
    split_dims: dict[str, int] = field(default_factory=dict)
    synced: list[nn.Module] = field(default_factory=list)
    out_sizes: Optional[list[int]] = None
    batch_gather: Optional[BatchGather] = None

    def add(self, name: Optional[str], module: nn.Module) -> None:
        """Append ``module``, the model's layer ``name`` (None for an exchange)."""
        self.modules.append(module)
        self.names.append(name)


def _slice_param(p: Optional[torch.Tensor], start: int, size: int) -> Optional[nn.Parameter]:
    if p is None:
        return None
    return nn.Parameter(p.detach().narrow(0, start, size).clone(), requires_grad=p.requires_grad)


def _slice_module(name: str, m: nn.Module, sizes_out: list[int], index: int, in_local: int,
                  part: SlicedPart, exchange: Optional[ExchangeSpec] = None) -> nn.Module:
    """This actor's slice of conv/linear/bn ``m`` (output dimension), registering split keys; with
    ``exchange``, the layer gathers its own input, overlapped (``GatheredConv2d``, ``GatheredLinear``)."""
    start, size = sum(sizes_out[:index]), sizes_out[index]
    prefix = f"{name}." if name else ""
    if isinstance(m, nn.Conv2d):
        groups = m.groups if in_local == m.in_channels else m.groups // len(sizes_out)
        new: nn.Module = (GatheredConv2d if exchange else nn.Conv2d)(in_local, size, m.kernel_size, m.stride,
                                                                     m.padding, m.dilation, groups,
                                                                     m.bias is not None, m.padding_mode)
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


def slice_layers(layers: list[tuple[str, nn.Module]], in_shape: tuple[int, ...],
                 out_shapes: list[tuple[int, ...]], in_sizes: Optional[list[int]], index: int, size: int,
                 group: Optional[dist.ProcessGroup], is_last: bool, exchange_chunks: int = 1) -> SlicedPart:
    """Filter-split ``layers`` over ``size`` actors; this is actor ``index``'s part.

    ``exchange_chunks`` > 1: each gather in front of a dense layer is done in that many batch pieces,
    overlapped with the layer (``overlapped_gather``); 1: one blocking ``Gather`` module.

    ``in_shape`` / ``out_shapes``: per-sample shapes of the part's input and each layer's output
    (from the routing). ``in_sizes``: slice sizes of the input along dim 1, None if replicated.
    Raises LayoutError for a layer that cannot be split (with what to change).
    """
    part = SlicedPart()
    sizes = in_sizes
    shape = in_shape
    for (name, m), out_shape in zip(layers, out_shapes):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            sizes = _split_dense(name, m, sizes, index, size, group, exchange_chunks, part)
        elif isinstance(m, PER_CHANNEL) or isinstance(m, ELEMENTWISE):
            part.add(name, _on_slice(name, m, sizes, index, part))
        elif isinstance(m, nn.Flatten) and m.start_dim == 1:
            if sizes is not None:
                spatial = math.prod(shape[1:])
                sizes = [s * spatial for s in sizes]
            part.add(name, m)
        else:
            raise LayoutError(
                f"filter split cannot divide layer {name or '<model>'} ({type(m).__name__}): "
                "it supports Conv2d, Linear, BatchNorm, pooling, activations, dropout and flatten "
                "(AlexNet, VGG, convnet); use --fs 1 for this model")
        shape = out_shape
    if is_last and sizes is not None:
        part.add(None, Gather(1, sizes, index, group, split_consumer=False))
        sizes = None
    part.synced = list(part.modules)
    part.out_sizes = sizes
    return part


def _split_dense(name: str, m: nn.Module, sizes: Optional[list[int]], index: int, size: int,
                 group: Optional[dist.ProcessGroup], exchange_chunks: int, part: SlicedPart) -> list[int]:
    """Add this actor's filters of conv or linear layer ``m`` to ``part``, after the exchange its input
    needs (a ``Scatter`` of a replicated input into a column-local grouped conv, a ``Gather`` of a
    sliced input into a dense layer, or none); ``sizes`` are the input's slice sizes (None when
    replicated). Returns the output's slice sizes. Raises LayoutError for a layer that cannot be split."""
    cout = m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
    if cout < size:
        raise LayoutError(f"splitting over {size} actors (--fs, or --dp under --plan) exceeds layer {name}'s "
                        f"{cout} output channels: use at most {cout}")
    sizes_out = split_sizes(cout, size)
    groups = getattr(m, "groups", 1)
    cin = m.in_channels if isinstance(m, nn.Conv2d) else m.in_features
    exchange = None
    if groups > 1 and groups % size == 0 and cin % size == 0 and cout % size == 0:
        # Column-local grouped conv: take (or keep) this actor's input channel slice.
        want = split_sizes(cin, size)
        if sizes is None:
            part.add(None, Scatter(1, want, index, group))
        elif sizes != want:
            raise LayoutError(f"layer {name} (groups={groups}) does not line up with the channel slices "
                            f"{sizes}: use an --fs that divides its groups")
        in_local = want[index]
    else:
        if groups > 1:
            raise LayoutError(f"layer {name} has groups={groups}, which --fs {size} does not divide: "
                            f"choose --fs dividing {groups}")
        if sizes is not None and exchange_chunks > 1:
            exchange = ExchangeSpec(1, sizes, index, group, exchange_chunks)
        elif sizes is not None:
            part.add(None, Gather(1, sizes, index, group, split_consumer=True))
        in_local = cin
    part.add(name, _slice_module(name, m, sizes_out, index, in_local, part, exchange))
    return sizes_out


def _on_slice(name: str, m: nn.Module, sizes: Optional[list[int]], index: int, part: SlicedPart) -> nn.Module:
    """A per-channel or elementwise layer as it runs on a channel slice (``sizes``; None: replicated):
    batch norm sliced, dropout sliced, others as they are. Raises LayoutError for batch norm on a
    replicated activation."""
    if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)) and sizes is not None:
        return _slice_module(name, m, sizes, index, 0, part)
    if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)):
        raise LayoutError(f"batch norm {name} on a replicated activation cannot be split")
    if isinstance(m, nn.Dropout) and sizes is not None:
        return SlicedDropout(m.p, sizes, index)
    return m


def whole_part(layers: list[tuple[str, nn.Module]]) -> SlicedPart:
    """No split: the layers as they are, every parameter synced over data parallel."""
    mods = [m for _, m in layers]
    return SlicedPart(modules=mods, names=[n for n, _ in layers],
                       synced=list(mods))

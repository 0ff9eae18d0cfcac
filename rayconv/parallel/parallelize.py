"""``parallelize``: one actor's part of the model, the parallelisms applied in one fixed order.

Every actor builds the same full model from the seed; ``parallelize`` turns it into the part this
actor runs, in this order (as torchtitan's ``parallelize`` applies its parallelisms by small
functions in one commented order):

1. cut: the layers of the actor's pipeline stage (its chunks under interleaved 1F1B), and
2. split: those layers filter-split over ``fs``, or laid out by Krizhevsky 2014's per-layer plan
   (``filter_split``). 1 and 2 are one call, ``routing.build_part``: a stage's input slice sizes
   come from the splits of the stages before it;
3. batch-norm mode: statistics over the global batch (``--sync-batchnorm``: ``nn.SyncBatchNorm``
   over the dp group), or running statistics that advance once per step under micro-batches
   (``batchnorm.DeferredBatchNorm``);
4. placement: device, dtype and, on GPUs, channels_last (before 5: the gradient buckets view each
   parameter with its final strides);
5. data-parallel sync: the modules replicated over the dp group start identical (broadcast from
   replica 0) and their gradients are all-reduced in buckets during the backward pass
   (``data_parallel.GradientSync``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rayconv.mesh import Coord
from rayconv.parallel.batchnorm import DeferredBatchNorm, defer_batchnorm
from rayconv.parallel.comm import Groups
from rayconv.parallel.data_parallel import GradientSync, broadcast_modules
from rayconv.parallel.filter_split.split import SlicedPart
from rayconv.parallel.routing import Routing, build_part


@dataclass
class ParallelPart:
    """One actor's part, ready to train.

    ``part``: its modules in order, placed; ``names[i]`` the model layer name of ``part[i]`` (None for
    an exchange); ``sliced``: what the split made (``split_dims``, ``out_sizes``, ``batch_gather``);
    ``in_sizes``: slice sizes of the part's input along dim 1 (None when replicated); ``replicated``:
    the modules replicated over the dp group; ``sync``: their gradient all-reduce; ``deferred_bn``: the
    batch-norm layers committed once per step; ``has_buffers``: whether ``replicated`` holds buffers
    (batch-norm statistics broadcast from replica 0 after each step)."""

    part: nn.Sequential
    names: list[Optional[str]]
    sliced: SlicedPart
    in_sizes: Optional[list[int]]
    replicated: list[nn.Module]
    sync: GradientSync
    deferred_bn: list[DeferredBatchNorm]
    has_buffers: bool


def parallelize(routing: Routing, layers: list[tuple[str, nn.Module]], coord: Coord, groups: Groups,
                device: torch.device, dtype: torch.dtype, sync_batchnorm: bool,
                bucket_mb: float) -> ParallelPart:
    """This actor's part of the model whose flat layers are ``layers`` (``models.to_layers``), at mesh
    coordinate ``coord``, in the order of the module docstring. Collective over the dp group (the
    broadcast). Raises LayoutError for a layer that cannot be split."""
    # 1-2. Cut and split.
    sliced, in_sizes = build_part(routing, layers, coord.pp, coord.fs, groups.axis["fs"], coord.dp,
                                   groups.axis["dp"])
    replicated_at = [any(m is s for s in sliced.synced) for m in sliced.modules]
    # 3. Batch-norm mode.
    part = nn.Sequential(*batchnorm_mode(sliced.modules, sync_batchnorm, routing.schedule.num_microbatches,
                                         groups.axis["dp"]))
    # 4. Placement.
    part.to(device=device, dtype=dtype)
    if device.type == "cuda":
        part.to(memory_format=torch.channels_last)
    # 5. Data-parallel sync.
    replicated = [m for m, r in zip(part, replicated_at) if r]
    sync = data_parallel(replicated, groups, bucket_mb)
    return ParallelPart(part=part, names=sliced.names, sliced=sliced, in_sizes=in_sizes,
                        replicated=replicated, sync=sync,
                        deferred_bn=[m for m in part.modules() if isinstance(m, DeferredBatchNorm)],
                        has_buffers=any(True for m in replicated for _ in m.buffers()))


def batchnorm_mode(modules: list[nn.Module], sync_batchnorm: bool, num_microbatches: int,
                   dp_group) -> list[nn.Module]:
    """``modules`` with their batch norm over the global batch (all replicas: ``sync_batchnorm``), or
    deferred to once a step under micro-batches (``parallel/batchnorm.py``), or as they are."""
    if sync_batchnorm:
        return [nn.SyncBatchNorm.convert_sync_batchnorm(m, process_group=dp_group) for m in modules]
    if num_microbatches > 1:
        return [defer_batchnorm(m) for m in modules]
    return list(modules)


def data_parallel(replicated: list[nn.Module], groups: Groups, bucket_mb: float) -> GradientSync:
    """Broadcast ``replicated`` from dp replica 0 (they start identical) and return the bucketed
    all-reduce of their gradients over the dp group (the first bucket at most 1 MB, as DDP's)."""
    dp_group = groups.axis["dp"]
    broadcast_modules(replicated, groups.ranks["dp"][0], dp_group)
    return GradientSync([p for m in replicated for p in m.parameters()], dp_group, bucket_mb,
                        first_bucket_mb=min(1.0, bucket_mb))

"""Krizhevsky 2014's per-layer plan ("One weird trick for parallelizing convolutional neural networks",
arXiv:1404.5997, section 4): convolutional layers data parallel over all N actors, then the batch is
gathered (each actor gets all N shards' features) and the fully connected layers are filter-split over
the same N actors. Backward: the partial feature gradients are reduce-scattered back to each actor's own
batch shard. Conv weights are all-reduced over the N actors; FC weights are not (each actor saw the
whole batch for its units).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from rayconv.errors import LayoutError
from rayconv.parallel.filter_split.exchanges import BatchGather
from rayconv.parallel.filter_split.split import SlicedPart, slice_layers


def krizhevsky2014(layers: list[tuple[str, nn.Module]], in_shape: tuple[int, ...],
                   out_shapes: list[tuple[int, ...]], index: int, size: int,
                   group: Optional[dist.ProcessGroup]) -> SlicedPart:
    """Conv layers data parallel, FC layers filter-split over the same ``size`` actors, the batch
    gathered before the first fully connected layer. Raises LayoutError without a Linear layer."""
    first_fc = next((i for i, (_, m) in enumerate(layers) if isinstance(m, nn.Linear)), None)
    if first_fc is None:
        raise LayoutError(
            "--plan krizhevsky2014 needs fully connected (Linear) layers to split: use --dp only")
    part = SlicedPart()
    for name, m in layers[:first_fc]:
        part.modules.append(m)
        part.names.append(name)
    part.synced = list(part.modules)
    part.batch_gather = BatchGather(index, group)
    part.modules.append(part.batch_gather)
    part.names.append(None)
    shape = out_shapes[first_fc - 1] if first_fc > 0 else in_shape
    fc = slice_layers(layers[first_fc:], shape, out_shapes[first_fc:], None, index, size, group, is_last=True)
    part.modules += fc.modules
    part.names += fc.names
    part.split_dims = fc.split_dims
    return part

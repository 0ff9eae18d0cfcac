"""Filter-split layers: what an actor runs in place of a model's layer under filter split.

``SlicedDropout`` draws the full activation's mask and keeps its slice, so the slices together drop
what one device would; ``GatheredConv2d`` and ``GatheredLinear`` are this actor's filters of a dense
layer that gathers its own channel-sliced input, overlapped with its compute
(``exchanges.overlapped_gather``). ``COMM_MODULES`` lists every module that communicates (kept
eager, between compiled segments: ``parallel/segments.py``).

Legend: N batch, C channels, F features; ``x_NCHW``, ``x_NF`` activations.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rayconv.parallel.filter_split.exchanges import (
    BatchGather,
    ExchangeSpec,
    Gather,
    Scatter,
    overlapped_gather,
)


class SlicedDropout(nn.Module):
    """Dropout on a channel (or unit) slice: the mask is drawn for the whole activation, from a
    generator that every actor of the split seeds alike each step (``reseed``), and each actor keeps
    its slice, so the slices together drop exactly what one device would draw for the full tensor
    (independent units, not the same mask repeated in every slice). Successive micro-batches of a
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
            raise RuntimeError("SlicedDropout.reseed must be called before training")
        full = list(x.shape)
        full[1] = sum(self.sizes)
        keep = torch.rand(full, generator=self.generator, device=x.device) >= self.p
        keep = keep.narrow(1, sum(self.sizes[:self.index]), self.sizes[self.index])
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, sizes={self.sizes}"



class GatheredConv2d(nn.Conv2d):
    """A filter-split convolution that needs every input channel, with the gather of its channel-sliced
    input overlapped with its own compute (``overlapped_gather``). Parameters and state_dict are those of
    ``nn.Conv2d`` (this actor's filters)."""

    exchange: ExchangeSpec

    def forward(self, x):
        return overlapped_gather(x, self.exchange, lambda full: self._conv_forward(full, self.weight,
                                                                                   self.bias))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_chunks={self.exchange.chunks}"


class GatheredLinear(nn.Linear):
    """``GatheredConv2d``'s fully connected counterpart (input ``x_NF`` sliced along F)."""

    exchange: ExchangeSpec

    def forward(self, x):
        return overlapped_gather(x, self.exchange, lambda full: nn.functional.linear(full, self.weight,
                                                                                     self.bias))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_chunks={self.exchange.chunks}"


COMM_MODULES = (Gather, Scatter, BatchGather, GatheredConv2d, GatheredLinear)

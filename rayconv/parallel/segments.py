"""torch.compile per segment of an actor's part, so that compiled code and communication overlap.

One compiled graph per part would hand every gradient to autograd only at the end of its backward
pass, so the data-parallel all-reduce could not start before the whole backward had run. As DDP's
graph splitting does for compiled models (``DDPOptimizer``, Ansel et al., "PyTorch 2", ASPLOS 2024,
section 6.3), the part is cut into segments at the gradient bucket size: each segment's gradients are
ready when its own backward ends, and their bucket is all-reduced while earlier segments run.
Exchange layers (filter-split gathers, the per-layer plan's batch gather) and sharded dropout (its
generator is shared across a split) stay eager, between segments.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from rayconv.parallel.filter_split.layers import COMM_MODULES, SlicedDropout

EAGER = (*COMM_MODULES, SlicedDropout)


def segments(modules: Sequence[nn.Module], max_bytes: Optional[int]) -> list[tuple[bool, list[nn.Module]]]:
    """Group ``modules`` into runs: (compile?, modules). Eager layers are runs of their own; other
    layers are grouped in order until a run holds ``max_bytes`` of parameters (None: no limit)."""
    out: list[tuple[bool, list[nn.Module]]] = []
    run: list[nn.Module] = []
    size = 0
    for m in modules:
        if isinstance(m, EAGER):
            if run:
                out.append((True, run))
            out.append((False, [m]))
            run, size = [], 0
            continue
        b = sum(p.numel() * p.element_size() for p in m.parameters())
        if run and max_bytes is not None and size + b > max_bytes:
            out.append((True, run))
            run, size = [], 0
        run.append(m)
        size += b
    if run:
        out.append((True, run))
    return out


def compile_part(part: nn.Sequential, max_bytes: Optional[int]) -> nn.Sequential:
    """``part`` as a Sequential of compiled segments (``torch.compile``, static shapes) and eager
    exchange layers. Parameters are shared with ``part`` (optimizer, gradient sync and checkpoints
    keep using ``part``); compilation happens on the first call of each segment."""
    out = []
    for compiled, mods in segments(list(part), max_bytes):
        if compiled:
            out.append(torch.compile(nn.Sequential(*mods), dynamic=False))
        else:
            out.extend(mods)
    return nn.Sequential(*out)

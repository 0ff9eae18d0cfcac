"""torch.compile per segment of an actor's part, so that compiled code and communication overlap.

One compiled graph per part would hand every gradient to autograd only at the end of its backward
pass, so the data-parallel all-reduce could not start before the whole backward had run. As DDP's
graph splitting does for compiled models (``DDPOptimizer``, Ansel et al., "PyTorch 2", ASPLOS 2024,
section 6.3), the part is cut into segments at the gradient bucket size: each segment's gradients are
ready when its own backward ends, and their bucket is all-reduced while earlier segments run.
Exchange layers (filter-split gathers, the per-layer plan's batch gather) and sliced dropout (its
generator is shared across a split) stay eager, between segments.

Segments compile with static shapes, and only for the calls of the run's full training step: an epoch's
last partial batch, evaluation chunks and the eval mode run the same modules eagerly
(``CompiledSegment``), so that a shape seen once an epoch costs no new compilation.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

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


class CompiledSegment(nn.Module):
    """A run of layers compiled (``torch.compile``, static shapes) for the calls it sees until
    ``fix_shapes``; afterwards a call of another (shape, train/eval mode, grad mode) runs the same
    layers eagerly instead of compiling again (each new static shape would cost a full compilation,
    tens of seconds, for a step that runs once an epoch). ``_orig_mod`` is the eager Sequential, as
    torch.compile's wrapper names it."""

    def __init__(self, seq: nn.Sequential, backend: Any = "inductor"):
        super().__init__()
        self._orig_mod = seq
        # (not a 2nd module)
        object.__setattr__(self, "compiled", torch.compile(seq, dynamic=False, backend=backend))
        self.shapes: set = set()
        self.fixed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = next(iter(self._orig_mod))  # (its mode follows the part's train()/eval(), this one's not)
        key = (tuple(x.shape), first.training, torch.is_grad_enabled())
        if not self.fixed:
            self.shapes.add(key)
        elif key not in self.shapes:
            return self._orig_mod(x)
        return self.compiled(x)


def fix_shapes(modules: Iterable[nn.Module]) -> None:
    """From now on the compiled segments in ``modules`` run compiled code only for the calls they have
    seen (called after the run's first full training step); other calls run eagerly."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, CompiledSegment):
                m.fixed = True


def compile_part(part: nn.Sequential, max_bytes: Optional[int]) -> nn.Sequential:
    """``part`` as a Sequential of compiled segments (``CompiledSegment``) and eager exchange layers.
    Parameters are shared with ``part`` (optimizer, gradient sync and checkpoints keep using ``part``);
    compilation happens on the first call of each segment."""
    out = []
    for compiled, mods in segments(list(part), max_bytes):
        if compiled:
            out.append(CompiledSegment(nn.Sequential(*mods)))
        else:
            out.extend(mods)
    return nn.Sequential(*out)

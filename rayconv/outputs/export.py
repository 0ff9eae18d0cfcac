"""Export: assemble the actors' parts into one plain state_dict that the model's builder loads, and save it.

Each actor returns its parameters and buffers keyed by the whole model's ``state_dict`` names
(``Actor.state``). Pipeline stages hold disjoint keys; data-parallel replicas hold equal copies (the
first replica's is taken); filter-split slices hold slices along the output dimension, concatenated
back here in fs order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayconv.files import atomic_write


def assemble(states: list[dict[str, torch.Tensor]], split_dims: dict[str, int]) -> dict[str, torch.Tensor]:
    """One state_dict from the parts held by ``states`` (in rank order, one replica's actors).

    A key held by several parts is concatenated along ``split_dims[key]`` if it is a filter-split
    shard, else (replicated) taken from the first holder.
    """
    out: dict[str, torch.Tensor] = {}
    keys = dict.fromkeys(k for s in states for k in s)
    for key in keys:
        parts = [s[key] for s in states if key in s]
        out[key] = torch.cat(parts, dim=split_dims[key]) if key in split_dims and len(parts) > 1 else parts[0]
    return out


def export_model(path: Path, state: dict[str, torch.Tensor], reference: nn.Module) -> None:
    """Check that ``state`` loads into ``reference`` (a freshly built model, strict), then save it
    atomically with ``torch.save``; it loads back with ``torch.load(path, weights_only=True)``.
    Raises RuntimeError (from ``load_state_dict``) if keys or shapes do not match."""
    reference.load_state_dict(state, strict=True)
    ordered: dict[str, Any] = {k: state[k].contiguous() for k in reference.state_dict()}
    atomic_write(path, lambda tmp: torch.save(ordered, tmp))

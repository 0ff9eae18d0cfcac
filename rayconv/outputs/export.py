"""Export: assemble the actors' parts into one plain state_dict that the model's builder loads, and save it.

Each actor returns its parameters and buffers keyed by the whole model's ``state_dict`` names
(``Actor.model_state``). Pipeline stages hold disjoint keys; data-parallel replicas hold equal copies (the
first replica's is taken); filter-split slices hold slices along the output dimension, concatenated
back here in fs order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from rayconv.files import atomic_write


def assemble(states: list[dict[str, torch.Tensor]], split_dims: dict[str, int]) -> dict[str, torch.Tensor]:
    """One state_dict from the parts held by ``states`` (in rank order, one replica's actors).

    A key held by several parts is concatenated along ``split_dims[key]`` if it is a filter-split
    slice, else (replicated) taken from the first holder.
    """
    out: dict[str, torch.Tensor] = {}
    keys = dict.fromkeys(k for s in states for k in s)
    for key in keys:
        parts = [s[key] for s in states if key in s]
        out[key] = torch.cat(parts, dim=split_dims[key]) if key in split_dims and len(parts) > 1 else parts[0]
    return out


def state_keys(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``model``'s state_dict keys in order, each with its tensor's shape: what ``export_model`` checks
    against (an actor records it from the model it built, so the driver builds none)."""
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def export_model(path: Path, state: dict[str, torch.Tensor],
                 keys: Sequence[tuple[str, Sequence[int]]]) -> None:
    """Check that ``state`` holds exactly the keys of ``keys`` (``state_keys`` of a freshly built model)
    with their shapes, as ``load_state_dict(strict=True)`` does, then save it in that key order atomically
    with ``torch.save``; it loads back with ``torch.load(path, weights_only=True)`` into the model.
    Raises RuntimeError naming the missing, unexpected and mis-shaped keys."""
    want = {k: tuple(shape) for k, shape in keys}
    missing = [k for k in want if k not in state]
    unexpected = [k for k in state if k not in want]
    mis_shaped = [f"{k} {tuple(state[k].shape)} (model {want[k]})" for k in want
                  if k in state and tuple(state[k].shape) != want[k]]
    if missing or unexpected or mis_shaped:
        raise RuntimeError(
            "the assembled state_dict does not load into the model: "
            + "; ".join(
                f"{what}: {', '.join(names[:5])}"
                for what, names in (("missing", missing), ("unexpected", unexpected), ("shapes", mis_shaped))
                if names
            )
        )
    ordered: dict[str, Any] = {k: state[k].contiguous() for k in want}
    atomic_write(path, lambda tmp: torch.save(ordered, tmp))

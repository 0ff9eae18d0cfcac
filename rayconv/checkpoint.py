"""Export: assemble the actors' parts into one plain state_dict that the model's builder loads.

Each actor returns its parameters and buffers keyed by the whole model's ``state_dict`` names
(``Worker.state``). Pipeline stages hold disjoint keys; data-parallel replicas hold equal copies (the
first replica's is taken); filter-split shards hold slices along the output dimension, concatenated
back here in fs order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .mesh import Mesh
from .metrics import atomic_write


def assemble(mesh: Mesh, states: dict[int, dict[str, torch.Tensor]], split_dims: dict[str, int]) -> dict[str, torch.Tensor]:
    """One state_dict from the states of replica 0's actors (``states[rank]``).

    ``split_dims[key]`` is the dimension along which filter-split shards of ``key`` are cut (keys not
    listed are replicated over fs, or fs is 1).
    """
    out: dict[str, torch.Tensor] = {}
    for p in range(mesh.pp):
        shards = [states[mesh.rank((0, p, f))] for f in range(mesh.fs)]
        for key in shards[0]:
            if key in split_dims and mesh.fs > 1:
                out[key] = torch.cat([s[key] for s in shards], dim=split_dims[key])
            else:
                out[key] = shards[0][key]
    return out


def export_model(path: Path, state: dict[str, torch.Tensor], reference: nn.Module) -> None:
    """Check that ``state`` loads into ``reference`` (a freshly built model, strict), then save it
    atomically with ``torch.save``; it loads back with ``torch.load(path, weights_only=True)``.
    Raises RuntimeError (from ``load_state_dict``) if keys or shapes do not match."""
    reference.load_state_dict(state, strict=True)
    ordered: dict[str, Any] = {k: state[k].contiguous() for k in reference.state_dict()}
    atomic_write(path, lambda tmp: torch.save(ordered, tmp))

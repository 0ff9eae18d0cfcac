"""Gradient clipping by the global norm over every part of the model (``--clip-grad-norm``).

``torch.nn.utils.clip_grad_norm_`` scales all gradients by ``min(1, max_norm / (||g|| + 1e-6))``, where
``||g||`` is the 2-norm of the whole model's gradient (Pascanu et al. 2013, "On the difficulty of
training recurrent neural networks", section 3.2). On a mesh each actor holds part of ``g``: the
squared norm is a sum over parameters, so each actor sums its own part (``local_sq_norm``, accumulated
in float64: float16 squares would overflow, and the sum's rounding stays far below float32's), the
caller all-reduces those
with SUM, then every actor computes the same ``clip_coefficient`` and applies it (``clip_``).

Which group to all-reduce over, and what to count: after the data-parallel all-reduce the replicas of
a part hold the same gradient, so the sum runs over the pipeline and filter-split groups (pp x fs),
not over dp, or each part would count dp times. Within that group a parameter held by more than one
actor (a layer left whole on several actors of the group, such as the data-parallel conv layers of
``--plan krizhevsky2014``) must also count once: pass it as ``replicated`` and let only one of its holders
count it (``count_replicated=True`` on, say, fs rank 0).
"""

from __future__ import annotations

from typing import Iterable

import torch

from rayconv.errors import ConfigError

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def local_sq_norm(params: Iterable[torch.Tensor], replicated: Iterable[torch.Tensor] = (),
                  count_replicated: bool = True, device: torch.device | None = None) -> torch.Tensor:
    """The squared 2-norm of the gradients this actor counts: of ``params`` (its part's own, split
    parameters) plus, when ``count_replicated``, of ``replicated``. A float64 0-dim tensor on the
    gradients' device (``device``, else CPU, when there are none); parameters without a gradient add 0.
    No host synchronisation."""
    grads = _grads(params) + (_grads(replicated) if count_replicated else [])
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    # per-gradient norms accumulated in float64 (no float64 copy of the gradients), one kernel per list
    norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float64)
    return torch.stack([n.to(grads[0].device) for n in norms]).square().sum()


def clip_coefficient(total_sq_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (sqrt(total_sq_norm) + 1e-6))``, the factor ``clip_grad_norm_`` scales the
    gradients by; ``total_sq_norm`` is the squared norm summed over the whole model (see the module
    docstring). A 0-dim tensor like ``total_sq_norm``; a non-finite norm gives a non-finite factor, as in
    torch (the step should then be skipped). Raises ConfigError for ``max_norm <= 0``."""
    if not max_norm > 0:
        raise ConfigError(f"--clip-grad-norm must be > 0 (got {max_norm})")
    return torch.clamp(max_norm / (total_sq_norm.sqrt() + EPS), max=1.0)


def clip_(params: Iterable[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply every gradient of ``params`` (part and replicated parameters alike: every holder
    scales its copy) by ``coefficient``, cast to each gradient's dtype and device, in place."""
    for g in _grads(params):
        g.mul_(coefficient.to(device=g.device, dtype=g.dtype))

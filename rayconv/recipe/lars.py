"""Layer-wise adaptive rate scaling for ``--opt lars`` (You, Gitman & Ginsburg 2017, "Large Batch Training
of Convolutional Networks", section 3 and Algorithm 1).

Each layer's weight tensor ``w`` with gradient ``g`` and weight decay ``wd`` gets its own local learning
rate, the trust ratio ``r = eta * ||w|| / (||g|| + wd * ||w||)`` (``eta``: ``--lars-trust-coefficient``;
``r = 1`` where either norm is 0, as at a zero-initialised layer), and momentum SGD then moves it by
``r * (g + wd * w)``. rayconv applies LARS as a gradient transform before torch's SGD (``g <- r * (g +
wd * w)``, that group's weight decay 0 inside the optimizer: ``lars_param_groups``), so the momentum
buffer and the checkpoint are torch's SGD's; the global learning rate multiplies outside the buffer, as
in torch's SGD. Norm layers' parameters and biases are left out of the adaptation and keep plain
momentum SGD with their own decay, as You et al.'s and MLPerf's implementations do.

On a mesh: a pipeline stage holds whole layers, so its ratios need nothing from other stages; a tensor
split over filter-split slices (or over the data-parallel group under Krizhevsky 2014's per-layer plan)
has its two squared norms summed over that group before the ratio (the caller's all-reduce between
``sq_norms`` and ``scale_``), so every part scales its slice by the whole tensor's ratio. No host
synchronisation (it can run inside a captured CUDA graph).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from rayconv.recipe.optim import param_groups

ADAPTED = "other"  # the parameter group LARS adapts: every parameter but norm layers' and biases


def lars_param_groups(module: torch.nn.Module, weight_decay: float, norm_weight_decay: Optional[float] = None,
                      bias_weight_decay: Optional[float] = None) -> list[dict[str, Any]]:
    """``param_groups`` with norm layers and biases always in groups of their own (decay
    ``norm_weight_decay`` / ``bias_weight_decay``, else ``weight_decay``), and the adapted group's decay
    moved to its ``lars_weight_decay`` key (the optimizer's ``weight_decay`` there 0: ``scale_`` adds it
    to the gradient before scaling). Raises ConfigError for a negative decay."""
    groups = param_groups(module, weight_decay,
                          weight_decay if norm_weight_decay is None else norm_weight_decay,
                          weight_decay if bias_weight_decay is None else bias_weight_decay)
    for g in groups:
        if g["name"] == ADAPTED:
            g["lars_weight_decay"], g["weight_decay"] = g["weight_decay"], 0.0
    return groups


def adapted_params(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, float]]:
    """The (parameter, weight decay) pairs of ``optimizer``'s groups built by ``lars_param_groups``."""
    return [(p, g["lars_weight_decay"]) for g in optimizer.param_groups if "lars_weight_decay" in g
            for p in g["params"]]


def sq_norms(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared 2-norms of each parameter and of its gradient (zero where it has none): float64,
    shape [2, len(params)] on ``device``, row 0 the weights', row 1 the gradients'. On a mesh the caller
    sums the columns of split tensors over the group holding their slices before ``scale_``."""
    if not params:
        return torch.zeros(2, 0, dtype=torch.float64, device=device)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    norms = torch._foreach_norm([t.detach() for t in (*params, *grads)], 2, dtype=torch.float64)
    return torch.stack([n.to(device) for n in norms]).square().view(2, len(params))


@torch.no_grad()
def scale_(params: Sequence[torch.Tensor], weight_decays: Sequence[float], sq: torch.Tensor, eta: float,
           decay_vector: Optional[torch.Tensor] = None) -> None:
    """Replace each ``params[i].grad`` by ``r_i * (grad + weight_decays[i] * param)``, where ``r_i = eta *
    ||w|| / (||g|| + wd * ||w||)`` from the whole tensor's squared norms ``sq[:, i]`` (``sq_norms``,
    summed over parts), or 1 where either norm is 0. Parameters without a gradient are left alone.
    ``decay_vector``: ``weight_decays`` as a float64 tensor on ``sq``'s device, made once by the caller
    so that a step captured as a CUDA graph copies nothing from the host (made here when None)."""
    if not params:
        return
    w_norm, g_norm = sq.sqrt()
    wd = decay_vector if decay_vector is not None else \
        torch.tensor(list(weight_decays), dtype=torch.float64, device=sq.device)
    ratio = torch.where((w_norm > 0) & (g_norm > 0), eta * w_norm / (g_norm + wd * w_norm),
                        torch.ones_like(w_norm))
    for k, p in enumerate(params):
        if p.grad is None:
            continue
        if weight_decays[k]:
            p.grad.add_(p, alpha=weight_decays[k])
        p.grad.mul_(ratio[k].to(p.grad.dtype))

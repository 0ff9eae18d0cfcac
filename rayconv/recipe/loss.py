"""Cross entropy with label smoothing, on class indices or soft targets, summed so that micro-batches add up.

torchvision's recipe trains with ``nn.CrossEntropyLoss(label_smoothing=eps)`` (``--label-smoothing``,
Szegedy et al. 2016, "Rethinking the Inception Architecture", section 7) and, under mixup or cutmix,
feeds it the mixed class probabilities. torch's ``F.cross_entropy`` takes both target kinds and smooths
both the same way (the target becomes ``(1 - eps) * y + eps / C``), so this module wraps it and adds the
reduction a split step needs: a micro-batch's summed loss divided by the *global* batch size. The
pieces of one step (micro-batches of every replica) then add up to the mean over the global batch, and
so do their gradients, whatever the layout; a per-piece mean would weight uneven pieces wrongly.

Legend: N samples, C classes; ``logits_NC``, ``target_N`` (int64 class indices) or ``target_NC``
(probabilities, each row summing to 1).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from rayconv.errors import ConfigError

REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(logits_NC: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of ``logits_NC`` against class indices ``target_N`` or probabilities
    ``target_NC`` (cast to the logits' dtype), smoothed by ``label_smoothing``; ``reduction`` ``mean``
    (over N), ``sum`` or ``none`` (shape (N,)). Raises ConfigError for ``label_smoothing`` outside
    [0, 1) or an unknown reduction, ValueError for a target whose shape fits neither kind."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ConfigError(f"--label-smoothing must be in [0, 1) (got {label_smoothing})")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"unknown reduction {reduction!r}: use one of {', '.join(REDUCTIONS)}")
    if target.dim() == 2:
        if target.shape != logits_NC.shape:
            raise ValueError(f"soft targets of shape {tuple(target.shape)} do not match logits "
                             f"{tuple(logits_NC.shape)}")
        target = target.to(logits_NC.dtype)
    elif target.dim() != 1 or target.shape[0] != logits_NC.shape[0] or target.is_floating_point():
        raise ValueError(f"targets must be class indices (N,) or probabilities (N, C); got "
                         f"{tuple(target.shape)} {target.dtype} for logits {tuple(logits_NC.shape)}")
    return F.cross_entropy(logits_NC, target, reduction=reduction, label_smoothing=label_smoothing)


def microbatch_loss(logits_NC: torch.Tensor, target: torch.Tensor, global_batch_size: int,
                    label_smoothing: float = 0.0) -> torch.Tensor:
    """This piece's share of the global-batch mean loss: the summed cross entropy of its N samples over
    ``global_batch_size`` (0-dim). Summing it over every micro-batch and replica of a step gives the
    mean over the global batch (and its backward the gradient of that mean, before any all-reduce
    averaging: all-reduce the gradients with SUM, or scale by the number of replicas before a mean).
    Raises ConfigError for ``global_batch_size < 1``."""
    if global_batch_size < 1:
        raise ConfigError(f"--global-batch-size must be >= 1 (got {global_batch_size})")
    return cross_entropy(logits_NC, target, label_smoothing, reduction="sum") / global_batch_size

"""The loss of a step, micro-batch by micro-batch, on the last virtual stage.

Each micro-batch's loss is its per-sample cross-entropy summed, divided by the global batch size
(all replicas' samples), so the gradients accumulated over micro-batches and summed over replicas
are those of single-device SGD on the global batch (uneven shards and a last partial batch stay
exact). Loss sum and correct counts stay on the device (no synchronisation inside the step).

Legend: N micro-batch size, K classes; ``logits_NK``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


class StepLoss:
    """``loss(m, logits_NK)`` for the pipeline runner: micro-batch m's scalar to back-propagate.

    ``labels(m)``: micro-batch m's labels on the device; ``global_count``: the samples the loss is
    divided by; ``top5``: also count samples whose label is among the 5 highest logits (evaluation,
    >= 5 classes). After the step: ``loss_sum`` (sum of per-sample losses), ``correct``, ``correct5``
    (None unless counted); 0.0, 0 and None on a stage that computes no loss."""

    def __init__(self, labels: Callable[[int], Optional[torch.Tensor]], global_count: int, top5: bool = False):
        self.labels, self.global_count, self.top5 = labels, global_count, top5
        self.loss_sum: object = 0.0
        self.correct: object = 0
        self.correct5: object = None

    def __call__(self, m: int, out: torch.Tensor) -> torch.Tensor:
        logits = out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
        y = self.labels(m)
        loss = nn.functional.cross_entropy(logits, y, reduction="sum")
        self.loss_sum = self.loss_sum + loss.detach()
        self.correct = self.correct + (logits.detach().argmax(1) == y).sum()
        if self.top5 and logits.shape[1] >= 5:
            top5 = (logits.detach().topk(5, 1).indices == y[:, None]).any(1).sum()
            self.correct5 = top5 if self.correct5 is None else self.correct5 + top5
        return loss / self.global_count

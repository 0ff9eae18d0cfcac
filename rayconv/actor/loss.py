"""The loss of a step, micro-batch by micro-batch, on the last virtual stage.

Each micro-batch's loss is its per-sample cross-entropy summed, divided by the global batch size
(all replicas' samples: ``recipe.loss.microbatch_loss``), so the gradients accumulated over
micro-batches and summed over replicas are those of single-device SGD on the global batch's mean loss
(uneven replica batches and a last partial batch stay exact). With ``--label-smoothing`` the cross entropy is
torch's smoothed one (Szegedy et al. 2016, section 7); targets may be class indices or probability
rows (mixup, cutmix). Under float16 loss scaling the back-propagated value is multiplied by the
scale; the reported sums are not. Loss sum and correct counts stay on the device (no synchronisation
inside the step).

Legend: N micro-batch size, K classes; ``logits_NK``; targets ``y_N`` (indices) or ``y_NK``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rayconv.recipe.loss import cross_entropy


class StepLoss:
    """``loss(m, logits_NK)`` for the pipeline runner: micro-batch m's scalar to back-propagate.

    ``labels(m)``: micro-batch m's targets on the device; ``global_count``: the samples the loss is
    divided by; ``top5``: also count samples whose label is among the 5 highest logits (evaluation,
    >= 5 classes); ``label_smoothing``: torch's, in [0, 1); ``scale``: the float16 loss scale the
    returned value is multiplied by (None: none). After the step: ``loss_sum`` (sum of per-sample
    losses, unscaled), ``correct`` (argmax equal to the label, or to the target row's largest
    probability), ``correct5`` (None unless counted); 0.0, 0 and None on a stage that computes no loss."""

    def __init__(self, labels: Callable[[int], Optional[torch.Tensor]], global_count: int, top5: bool = False,
                 label_smoothing: float = 0.0, scale: Optional[float] = None):
        self.labels, self.global_count, self.top5 = labels, global_count, top5
        self.label_smoothing, self.scale = label_smoothing, scale
        self.loss_sum: object = 0.0
        self.correct: object = 0
        self.correct5: object = None
        # ``pair()`` made at the end of a GPU step (``step.forward_backward_update``)
        self.held: Optional[torch.Tensor] = None

    def __call__(self, m: int, out: torch.Tensor) -> torch.Tensor:
        logits = out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
        y = self.labels(m)
        loss = cross_entropy(logits, y, self.label_smoothing, reduction="sum")
        self.loss_sum = self.loss_sum + loss.detach()
        cls = y.argmax(1) if y.dim() == 2 else y
        self.correct = self.correct + (logits.detach().argmax(1) == cls).sum()
        if self.top5 and logits.shape[1] >= 5:
            top5 = (logits.detach().topk(5, 1).indices == cls[:, None]).any(1).sum()
            self.correct5 = top5 if self.correct5 is None else self.correct5 + top5
        scaled = loss / self.global_count
        return scaled if self.scale is None else scaled * self.scale

    def pair(self) -> Optional[torch.Tensor]:
        """float64 (2,) [loss_sum, correct] on the device after the step, or None on a stage that
        computes no loss: one tensor to copy to the host (made inside a captured step, so that a
        replay leaves it ready without further launches)."""
        if not isinstance(self.loss_sum, torch.Tensor):
            return None
        return torch.stack([self.loss_sum.to(torch.float64), torch.as_tensor(self.correct).to(torch.float64)])

"""Batch norm under micro-batches: running statistics advance once per step, from the whole batch.

A step that runs a replica's batch as M micro-batches (pipeline schedules, or ``--num-microbatches``
alone) would let ``nn.BatchNorm`` update its running statistics M times a step, each from one
micro-batch. ``DeferredBatchNorm`` (torchgpipe's deferred batch normalisation, Kim et al. 2020,
"torchgpipe", section 3.4) instead accumulates each micro-batch's statistics during the step and
``commit`` folds them into the running statistics once at the end of the step, as one ``nn.BatchNorm``
call on the whole batch would: ``running_mean``/``running_var`` move by the momentum towards the
batch's mean and unbiased variance, ``num_batches_tracked`` grows by 1, and ``momentum=None`` gives the
cumulative average over the steps. The training forward pass still normalises each micro-batch by its
own statistics (as each DDP replica normalises by its own); evaluation uses the running statistics.

Micro-batches are combined as Chan, Golub and LeVeque (1979) combine partial variances: per channel,
the accumulator holds the count n, mean and sum of squared deviations M2 of the micro-batches seen so
far (not the sum of squares, whose difference loses precision in float32). Everything is tensor
arithmetic on fixed buffers, with no host synchronisation and no branch on a tensor's value, so a
step that accumulates and commits can be captured as a CUDA graph (``cuda_graph.py``) or compiled.
The accumulators are per-step scratch: zero between steps, non-persistent (not in ``state_dict``,
hence not in checkpoints). Every training forward adds its micro-batch: a forward run again to
recompute activations (activation checkpointing, which rayconv does not use) would add it twice,
which torchgpipe avoids by tracking only outside recomputation.

Legend: N micro-batch size, C channels; ``x_NC*`` a batch-norm input (``x_NC``, ``x_NCL``, ``x_NCHW``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm


class DeferredBatchNorm(_BatchNorm):
    """A batch-norm layer (1d, 2d or 3d) whose running statistics advance once per ``commit``.

    Made from an ``nn.BatchNorm*d`` by ``defer_batchnorm``, sharing its parameters and running buffers
    (same ``state_dict`` keys). Training forward: ``x_NC*`` normalised by its own batch statistics, which
    are also added to the step's accumulators; eval forward: by the running statistics.
    ``commit()`` ends each training step.
    """

    def __init__(self, bn: _BatchNorm):
        assert bn.track_running_stats, "only layers that track running statistics need deferring"
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, track_running_stats=True,
                         device=bn.running_mean.device, dtype=bn.running_mean.dtype)
        self.weight, self.bias = bn.weight, bn.bias  # (None without affine)
        self.running_mean, self.running_var = bn.running_mean, bn.running_var
        self.num_batches_tracked = bn.num_batches_tracked
        self.training = bn.training
        self._check = type(bn)._check_input_dim
        like = bn.running_mean
        # (count in float64: float32 counts are exact only to 2**24 values per channel)
        self.register_buffer("acc_count", torch.zeros((), dtype=torch.float64, device=like.device),
                             persistent=False)
        self.register_buffer("acc_mean", torch.zeros_like(like), persistent=False)
        self.register_buffer("acc_m2", torch.zeros_like(like), persistent=False)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        self._check(self, x)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.acc_count = self.acc_count.to(torch.float64)  # (a .to(dtype) of the layer keeps the count exact)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        self._check_input_dim(x)
        with torch.no_grad():
            self._track(x.detach())
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _track(self, x: torch.Tensor) -> None:
        """Add micro-batch ``x_NC*``'s per-channel statistics to the accumulators (Chan et al. 1979)."""
        if x.numel() == 0:
            return  # (an empty micro-batch: nothing to add; a branch on the shape, fixed in a capture)
        if x.dtype != self.acc_mean.dtype:
            x = x.to(self.acc_mean.dtype)  # (bf16 activations: statistics in the running buffers' dtype)
        dims = [0, *range(2, x.dim())]
        var_b, mean_b = torch.var_mean(x, dims, correction=0)  # (C,), (C,)
        n_b = x.numel() // x.size(1)
        n_a = self.acc_count
        w = n_b / (n_a + n_b)                   # 1 for the first micro-batch: exactly its statistics
        delta = mean_b - self.acc_mean
        self.acc_m2.add_(var_b * n_b + delta * delta * (n_a * w))
        self.acc_mean.add_(delta * w)
        self.acc_count.add_(n_b)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the step's accumulated statistics into the running ones (once per step), then clear them."""
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative average, as nn.BatchNorm with momentum=None
            f = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)
        else:
            f = self.momentum
        # No sample seen this step (every micro-batch empty): the running statistics stay, as
        # nn.BatchNorm leaves them on an empty batch (num_batches_tracked still counts the step).
        f = f * (self.acc_count > 0).to(self.running_mean.dtype)
        var = self.acc_m2 / (self.acc_count - 1)  # unbiased, as nn.BatchNorm's running_var
        self.running_mean.mul_(1 - f).add_(self.acc_mean * f)
        self.running_var.mul_(1 - f).add_(var * f)
        self.acc_count.zero_()
        self.acc_mean.zero_()
        self.acc_m2.zero_()

    def extra_repr(self) -> str:
        return super().extra_repr() + ", deferred"


def defer_batchnorm(module: nn.Module) -> nn.Module:
    """``module`` with every batch-norm layer that tracks running statistics (``module`` itself, or
    nested) replaced by a ``DeferredBatchNorm`` sharing its tensors; others (``track_running_stats``
    False, SyncBatchNorm) are kept as they are. Returns ``module`` or its replacement."""
    if (
        isinstance(module, _BatchNorm)
        and not isinstance(module, nn.SyncBatchNorm)
        and module.track_running_stats
    ):
        return DeferredBatchNorm(module)
    for name, child in module.named_children():
        new = defer_batchnorm(child)
        if new is not child:
            setattr(module, name, new)
    return module


def commit_batchnorm(layers: Iterable[DeferredBatchNorm]) -> None:
    """``commit()`` each layer: the end of a training step (after its last micro-batch's forward)."""
    for m in layers:
        m.commit()


def tracking_batchnorms(module: nn.Module) -> list[_BatchNorm]:
    """Every batch-norm layer in ``module`` that tracks running statistics (``nn.BatchNorm*d``,
    ``DeferredBatchNorm``, ``nn.SyncBatchNorm``), in module order."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


@contextmanager
def averaged_statistics(layers: list[_BatchNorm]) -> Iterator[None]:
    """Inside the block each layer's running statistics start afresh (mean 0, variance 1, count 0) at
    ``momentum=None``, so that the batches seen inside (one ``forward`` of ``nn.BatchNorm`` or
    ``nn.SyncBatchNorm``, or the micro-batches before one ``commit`` of a ``DeferredBatchNorm``, per batch)
    leave ``running_mean``/``running_var`` at the plain average of the batches' means and unbiased
    variances: ``torch.optim.swa_utils.update_bn``'s arithmetic (precise BN, Wu and Johnson 2021,
    section 3). After it, each layer's momentum and ``num_batches_tracked`` are restored and the averaged
    statistics stay. Everything is changed in place (captured and compiled code keeps its tensors)."""
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in layers]
    for m in layers:
        m.reset_running_stats()
        m.momentum = None
    try:
        yield
    finally:
        for m, (momentum, count) in zip(layers, saved):
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)

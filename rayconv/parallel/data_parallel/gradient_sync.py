"""Data parallelism: identical start, then gradients summed over the replicas of each part.

Each replica's loss is ``sum of per-sample losses / global batch size`` (weights by sample count, so
uneven replica batches and a last partial batch stay exact), hence the all-reduce is a plain SUM and one step
equals one single-device SGD step on the global batch (Yadan et al. 2013, section 3.1; the
bucketing and overlap with the backward pass follow PyTorch DDP, Li et al. VLDB 2020, section 3.2).

Buckets of about ``bucket_mb`` MB are formed in reverse parameter order (the order in which the
backward pass produces gradients). When armed (the last backward of a step), a hook on each parameter
notes its gradient as ready; a bucket is launched as an asynchronous all-reduce as soon as it is full
and every earlier bucket has been launched, so all replicas issue collectives in the same order.
``finish()`` launches what is left (parameters that got no gradient contribute zeros), waits, and
copies the sums back.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from rayconv.parallel import comm


class GradientSync:
    """Bucketed, backward-overlapped gradient all-reduce of ``params`` over ``group``.

    ``group`` None (one replica) makes every method a no-op. ``bucket_mb`` is in MB (2**20 bytes);
    the first bucket (the last layers, whose gradients come first) is capped at ``first_bucket_mb`` so
    that communication starts early in the backward pass, as DDP does. Each bucket is a persistent flat
    buffer; gradients are copied in and the sums out with one multi-tensor copy per bucket, through
    views that share each parameter's strides (channels_last weights included), so no layout conversion.
    """

    def __init__(self, params: list[nn.Parameter], group: Optional[dist.ProcessGroup],
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0):
        self.group = group
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        self.bucket_bytes = int(bucket_mb * 2**20)
        if group is None:
            return
        cur: list[nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            limit = int(first_bucket_mb * 2**20) if not self.buckets else self.bucket_bytes
            if cur and (size + p.numel() * p.element_size() > limit or p.dtype != cur[0].dtype):
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += p.numel() * p.element_size()
        if cur:
            self.buckets.append(cur)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.flats: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        for b in self.buckets:
            flat = torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
            views, offset = [], 0
            for p in b:
                dense = p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last)
                views.append(flat.as_strided(p.shape, p.stride(), offset) if dense else
                             flat[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            self.flats.append(flat)
            self.views.append(views)
        self.armed = False
        self._reset()
        # Handles kept: the hooks hold this object, and through it the process group, from C++, where
        # Python's garbage collector cannot see the cycle; close() removes them.
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def close(self) -> None:
        """Remove the gradient hooks and drop the process group (call before destroying the group)."""
        for h in getattr(self, "_hooks", ()):
            h.remove()
        self._hooks, self.launched, self.group = [], [], None

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.launched: list[object] = []

    def arm(self) -> None:
        """Call before the last backward pass of the step: from now on, full buckets are sent."""
        if self.group is not None:
            self.armed = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(p)]
        self.missing[i] -= 1
        while len(self.launched) < len(self.buckets) and self.missing[len(self.launched)] == 0:
            self._launch(len(self.launched))

    def _launch(self, i: int) -> None:
        views = self.views[i]
        have = [(v, p.grad) for v, p in zip(views, self.buckets[i]) if p.grad is not None]
        if len(have) < len(views):  # parameters without a gradient this step contribute zeros
            self.flats[i].zero_()
        if have:
            torch._foreach_copy_([v for v, _ in have], [g for _, g in have])
        self.launched.append(comm.all_reduce_sum(self.flats[i], self.group, async_op=True))

    def finish(self) -> None:
        """Launch remaining buckets, wait for all and write the summed gradients back."""
        if self.group is None:
            return
        while len(self.launched) < len(self.buckets):
            self._launch(len(self.launched))
        for i, work in enumerate(self.launched):
            work.wait()
            grads, views = [], []
            for p, v in zip(self.buckets[i], self.views[i]):
                if p.grad is None:
                    p.grad = v.clone()
                else:
                    grads.append(p.grad)
                    views.append(v)
            if grads:
                torch._foreach_copy_(grads, views)
        self.armed = False
        self._reset()


def broadcast_modules(modules: list[nn.Module], src: int, group: Optional[dist.ProcessGroup],
                      buffers_only: bool = False) -> None:
    """Copy parameters (unless ``buffers_only``) and buffers of ``modules`` from global rank ``src``
    to every rank of ``group``, so replicas start identical and batch-norm running statistics follow
    replica 0, as in DDP's ``broadcast_buffers``. Tensors are coalesced: one broadcast per dtype
    (ResNet-50 has 159 batch-norm buffers; one collective each cost more than the step's all-reduce)."""
    if group is None:
        return
    tensors = []
    for m in modules:
        tensors += [] if buffers_only else [p.data for p in m.parameters()]
        tensors += list(m.buffers())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            comm.broadcast(flat, src, group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

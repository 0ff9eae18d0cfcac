"""A batch's device-side augmentation replayed as one CUDA graph per batch shape.

Data held on the device (``OnDeviceSource``) and raw-pixel shards (``RawShardSource``) make each batch
on the GPU from uint8 pixels: a gather, the center crop, pad-crop and mirror, the normalisation, random
erasing (``augment.py``): a few dozen small kernels, each launched from Python by the actor's step
thread. A short step (resnet18 at 32 px) is then bound by those launches rather than by the GPU, so each
batch shape's augmentation is captured once as a CUDA graph and replayed: one launch a batch (CUDA
semantics notes, "CUDA Graphs"; the same mechanism as ``actor/cuda_graph.py``'s training step).

``ReplayedAugment(fn)(key, held, **inputs)`` returns ``fn(key, **held, **inputs)``, exactly (a replay runs
the same kernels on the same values):

- ``inputs`` are copied into device buffers that the capture reads: host tensors (a batch's pixels, its
  sample indices; pinned, so that the copies are asynchronous) before every replay, device tensors
  (an epoch's augmentation table) when another tensor object is given than the last time (a device
  input is not changed in place between calls);
- ``held`` device tensors (the images held on the device) are read where they lie; a capture holds for
  as long as the same objects are given;
- the first call of a shape runs ``fn`` eagerly (kernels load, constants made on first use such as
  the mean and std are made), the next one captures; ``key`` names whatever else ``fn`` depends on
  (the split's augmentation, the output dtype);
- the result is a new tensor (a device copy of the graph's output), which the caller may keep.

Off CUDA, ``fn`` simply runs. ``fn`` must not synchronise with the host (no ``.item()``,
``.tolist()``, data-dependent shapes): auto-augment's per-group loop does, and runs eagerly.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

import torch


class _Capture:
    """One shape's graph: device buffers of its inputs (and the objects last copied into them), the
    held tensors it read, its output."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static: dict[str, torch.Tensor],
                 held: dict[str, torch.Tensor], out: torch.Tensor):
        self.graph, self.static, self.held, self.out = graph, static, held, out
        self.last: dict[str, torch.Tensor] = {}

    def holds_for(self, held: dict[str, torch.Tensor]) -> bool:
        return all(held[k] is t for k, t in self.held.items())   # (the names are the signature's)

    def fill(self, inputs: dict[str, torch.Tensor]) -> None:
        """Copy ``inputs`` into the buffers: host ones always, device ones when they are new objects."""
        for k, buf in self.static.items():
            t = inputs[k]
            if not t.is_cuda or self.last.get(k) is not t:
                buf.copy_(t, non_blocking=True)
                if t.is_cuda:
                    self.last[k] = t


class ReplayedAugment:
    """``fn(key, **held, **inputs) -> Tensor`` on a CUDA device, replayed per shape (module docstring)."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn
        self.captures: dict[Hashable, _Capture] = {}
        self.seen: set = set()       # shapes run once eagerly (the warm-up)
        self.stream: Optional[torch.cuda.Stream] = None

    @staticmethod
    def signature(key: Hashable, tensors: dict[str, torch.Tensor]) -> tuple:
        """What fixes a capture: ``key``, and each tensor's name, shape, strides, dtype and device."""
        return (key,) + tuple((k, tuple(t.shape), t.stride(), t.dtype, t.device)
                              for k, t in sorted(tensors.items()))

    def __call__(self, key: Hashable, held: dict[str, torch.Tensor], **inputs: torch.Tensor) -> torch.Tensor:
        on_gpu = [t for t in (*held.values(), *inputs.values()) if t.is_cuda]
        if not on_gpu and not any(t.is_pinned() for t in inputs.values()):
            return self.fn(key, **held, **inputs)
        device = on_gpu[0].device if on_gpu else torch.device("cuda", torch.cuda.current_device())
        sig = self.signature(key, {**held, **inputs})
        cap = self.captures.get(sig)
        if cap is None or not cap.holds_for(held):
            if sig not in self.seen:
                self.seen.add(sig)
                return self.fn(key, **held, **{k: t.to(device, non_blocking=True) for k, t in inputs.items()})
            cap = self.captures[sig] = self._capture(key, held, inputs, device)
        cap.fill(inputs)
        cap.graph.replay()
        return cap.out.clone()

    def _capture(self, key: Hashable, held: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                 device: torch.device) -> _Capture:
        """Capture ``fn`` over device buffers shaped as ``inputs`` and the ``held`` tensors."""
        static = {k: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                  for k, t in inputs.items()}
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the actor (Ray's own, a loader's) touch CUDA meanwhile.
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            out = self.fn(key, **held, **static)
        current.wait_stream(self.stream)
        return _Capture(graph, static, dict(held), out)

"""The whole training step as one CUDA graph: forward, backward, the exchanges and all-reduces, the update.

A short step (AlexNet's on a fast GPU) takes less time than the CPU needs to launch its kernels one
by one, which leaves the GPUs idle for much of the step (benchmarks/RESULTS.md, RQ4); instead
each actor records its step once and replays it: one launch per step instead of hundreds. This is
PyTorch's "whole-network capture" (torch.cuda.graphs, CUDA semantics notes); NCCL collectives and
point-to-point operations are captured as kernels too (NCCL >= 2.9, "Using NCCL with CUDA Graphs").
Every rank of a process group captures the same operations in the same order, because every rank runs
the same step program.

What a replay needs, and how it is kept:
- inputs at fixed addresses: images and labels are copied into static buffers before each replay;
- a learning rate that can change per step: the update reads it from a device tensor
  (``sgd_step``; torch.optim.SGD reads a tensor learning rate on the host, which a graph cannot);
- dropout: the seeds set before a replay reach the captured kernels through the generators'
  graph-safe state (the default CUDA generator, and each registered ``torch.Generator``);
- the same shapes: each step shape has a graph of its own (the full batch's, and an epoch's last, partial
  batch's, captured after it ran eagerly once).
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Iterable, Optional

import torch


@torch.no_grad()
def sgd_step(optimizer: torch.optim.SGD, lr: dict[torch.dtype, torch.Tensor]) -> None:
    """``optimizer``'s SGD update (momentum, Nesterov momentum, each group's own weight decay; no
    dampening) with the learning rate read on the device from ``lr[dtype]`` (a 0-d tensor per parameter
    dtype), so it can be captured. The arithmetic is torch.optim.SGD's: ``g += wd * p``; ``buf = m * buf
    + g`` (the first step: ``buf = g``); ``g = g + m * buf`` with Nesterov, else ``g = buf``; ``p -= lr * g``.

    Float32 and lower parameters on a GPU take torch's fused SGD kernel (one pass over parameters,
    gradients and momentum: AlexNet's 61 M parameters made the unfused update a millisecond of every
    step); it reads the learning rate in float32, which is what float32 arithmetic uses anyway. Float64
    parameters (and CPUs) take torch.optim.SGD's foreach arithmetic, the learning rate in float64.
    Momentum buffers live in ``optimizer.state`` (checkpoints are the usual SGD state_dict); the first
    step makes them as torch.optim.SGD does. (AdamW is not captured: ``--opt adamw`` steps run eagerly,
    ``build.py``.) Raises ValueError for dampening or maximize."""
    for group in optimizer.param_groups:
        if group.get("dampening", 0) or group.get("maximize", False):
            raise ValueError("CUDA graph steps support SGD with (Nesterov) momentum and weight decay only")
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        grads = [p.grad for p in params]
        wd, momentum, nesterov = group["weight_decay"], group["momentum"], group.get("nesterov", False)
        bufs = [optimizer.state[p].get("momentum_buffer") for p in params] if momentum else []
        lr_t = lr[params[0].dtype]
        first = any(b is None for b in bufs)
        if params[0].is_cuda and params[0].dtype != torch.float64 and not first:
            torch._fused_sgd_(params, grads, bufs, weight_decay=wd, momentum=momentum, lr=lr_t, dampening=0.0,
                              nesterov=nesterov, maximize=False, is_first_step=False)
            continue
        if wd:
            grads = torch._foreach_add(grads, params, alpha=wd)
        if momentum:
            if first:  # the buffer starts as the gradient (torch.optim.SGD)
                for p, g in zip(params, grads):
                    optimizer.state[p]["momentum_buffer"] = g.detach().clone()
            else:
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, grads)
            bufs = [optimizer.state[p]["momentum_buffer"] for p in params]
            grads = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
        torch._foreach_sub_(params, torch._foreach_mul(grads, lr_t))


class StepGraph:
    """One actor's captured training steps, one CUDA graph per step shape.

    ``warmup`` eager steps run first (on the capture stream: libraries set up per-stream state, compiled
    code compiles, NCCL connects its peers); the next step of ``key`` (whatever fixes a step's shapes:
    the per-replica batch sizes of a full global batch) is captured and replayed from then on. A step of
    another key (an epoch's last, partial batch) runs eagerly once (cuDNN picks its algorithms for the
    shape; the warm-up of ``key`` set up the rest), then is captured too, in a graph and memory pool of its
    own, and replayed at each epoch's end; at most ``MAX_KEYS`` keys are captured, later ones stay eager.
    Every step of a key replays the same graph, and every rank captures the same keys at the same steps (a key
    is the global batch's split), so the graphs' collectives match across ranks.
    """

    MAX_KEYS = 2

    def __init__(self, device: torch.device, key: Hashable, warmup: int = 2):
        self.device, self.key, self.warmup = device, key, warmup
        self.stream = torch.cuda.Stream(device)
        # key -> (graph, what step returned)
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.eager_runs: dict[Hashable, int] = {}   # key -> eager steps of that key so far
        self.static: dict[tuple, torch.Tensor] = {}
        self.capture_s: Optional[float] = None  # host seconds of the last capture, until taken
        # whether the last ``run`` replayed a capture made before it: it set no gradient attribute
        # (a replay writes the graph's own gradient memory; ``.grad`` stays as it was after the capture)
        self.replayed = False

    def take_capture_s(self) -> Optional[float]:
        """Seconds the capture made by the last ``run`` took (None when it made none); reported once."""
        s, self.capture_s = self.capture_s, None
        return s

    def reset(self) -> None:
        """Forget the captures (after tensors they recorded were replaced, e.g. optimizer state loaded)."""
        self.graphs, self.eager_runs, self.replayed = {}, {}, False
        self.static = {}

    def buffer(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` copied into the static buffer ``name`` of its shape (made on first use, same shape and
        layout): a captured step reads its inputs there. Steps of two keys may share a buffer of one
        shape: each copies its own input in before its replay, on the stream the replays run on."""
        buf = self.static.get((name, value.shape, value.dtype))
        if buf is None:
            buf = self.static[(name, value.shape, value.dtype)] = torch.empty_like(value)
        buf.copy_(value, non_blocking=True)
        return buf

    @property
    def eager_steps(self) -> int:
        """Steps run eagerly so far, of every key."""
        return sum(self.eager_runs.values())

    def will_replay(self, key: Hashable) -> bool:
        """Whether the step of ``key`` replays (or captures) rather than running eagerly."""
        if key in self.graphs:
            return True
        if key == self.key:
            return self.eager_steps >= self.warmup
        return (self.eager_steps >= self.warmup and self.eager_runs.get(key, 0) >= 1
                and len(self.graphs) < self.MAX_KEYS)

    def eager(self, step: Callable[[], object]) -> object:
        """Run ``step()`` eagerly on the capture stream, as warm-up steps run (a profiled step between
        replays: its autograd nodes and library state stay on the stream the capture used)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = step()
        current.wait_stream(self.stream)
        return out

    def run(self, key: Hashable, step: Callable[[], object],
            generators: Iterable[torch.Generator] = ()) -> object:
        """Run ``step()`` eagerly (warm-up, or a shape not captured yet) or replay its key's capture.
        Returns what ``step`` returned (from the capture when replaying: its tensors hold this step's
        values after the replay). Raises what capture raises (an operation a graph cannot hold)."""
        self.replayed = key in self.graphs
        if not self.will_replay(key):
            self.eager_runs[key] = self.eager_runs.get(key, 0) + 1
            return self.eager(step)
        if key not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            for g in generators:
                graph.register_generator_state(g)  # (the default CUDA generator is registered already)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            t0 = time.perf_counter()
            # thread_local: Ray's and NCCL's own threads may touch CUDA while this thread captures.
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                out = step()
            self.graphs[key] = (graph, out)
            self.capture_s = time.perf_counter() - t0
        graph, out = self.graphs[key]
        graph.replay()
        return out

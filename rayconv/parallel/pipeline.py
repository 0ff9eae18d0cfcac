"""Pipeline parallelism: cut the flat layer list into stages, run a stage's program of micro-batches.

Stages are contiguous runs of layers (GPipe, Huang et al. 2019, section 2.2). ``balance`` cuts them
so that the largest stage cost is smallest (cost per layer: forward FLOPs from
``torch.utils.flop_counter``, or parameter count). A stage runs its program from ``rayconv.schedule``
(GPipe or 1F1B): F(m) receives the activation of micro-batch m from the previous stage (or reads
it from the data), runs the stage, and sends the output on (non-blocking); B(m) receives the output
gradient from the next stage (or starts from the loss), runs backward and sends the input gradient
back. A send is posted together with the next action's receive as one NCCL group
(``comm.exchange``), so crossing sends of 1F1B cannot deadlock (``schedule.check_exchanges`` replays
these batches under NCCL's rules, unbuffered, for every schedule ``make_plan`` accepts). Gradients accumulate over
micro-batches; the loss of each micro-batch is its per-sample sum divided by the global batch size,
so the accumulated gradient is the single-device one.

Legend: N micro-batch size, C channels, H, W height, width; ``x_NCHW`` an activation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import Action
from . import comm


class PlanError(ValueError):
    """A layout cannot be applied to this model (too many stages, bad cut points, ...)."""


def balance(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Cut ``costs`` (one per layer) into ``num_stages`` contiguous non-empty runs minimising the
    largest run's sum (linear partition by dynamic programming, O(L^2 * P)). Returns [start, end) pairs.
    Raises PlanError if there are fewer layers than stages."""
    n = len(costs)
    if num_stages > n:
        raise PlanError(f"--pp {num_stages} needs at least {num_stages} cuttable layers but the model has {n}: "
                        f"lower --pp to at most {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal max-stage cost splitting the first i layers into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def parse_stages(spec: str, num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``--stages '5,9'``: the first layer index of stages 1.. (so 3 stages: [0,5), [5,9), [9,L)).
    Raises PlanError naming what to change."""
    try:
        cuts = [int(s) for s in spec.replace(" ", "").split(",") if s]
    except ValueError:
        raise PlanError(f"--stages {spec!r}: give comma-separated layer indices, e.g. '5,9'") from None
    if len(cuts) != num_stages - 1:
        raise PlanError(f"--stages {spec!r} gives {len(cuts) + 1} stages but --pp is {num_stages}: "
                        f"give {num_stages - 1} cut point(s)")
    edges = [0, *cuts, num_layers]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise PlanError(f"--stages {spec!r}: cut points must increase strictly within 1..{num_layers - 1}")
    return list(zip(edges, edges[1:]))


@dataclass
class StepResult:
    # Kept on the device (no synchronisation inside the step); read with float()/int() when needed.
    loss_sum: object = 0.0    # sum of per-sample losses over this replica's samples (last stage only)
    correct: object = 0       # correctly classified samples (last stage only)
    wait_s: Optional[float] = 0.0  # seconds blocked in receives (measured only when profiling eagerly)
    samples: int = 0          # samples this replica saw
    sends: list = field(default_factory=list)


class StageRunner:
    """Runs one pipeline stage's program for one step.

    ``module`` is this stage's part of the model; ``prev`` / ``next`` are global ranks of the
    neighbouring stages (None at the ends); ``in_shape`` / ``out_shape`` are per-sample shapes of
    the tensors received from ``prev`` and sent to ``next``; ``wire_dtype`` is the dtype on the wire.
    """

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup], prev: Optional[int],
                 next_: Optional[int], in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                 wire_dtype: torch.dtype, device: torch.device, autocast: Optional[torch.dtype]):
        self.module, self.group, self.prev, self.next = module, group, prev, next_
        self.in_shape, self.out_shape = in_shape, out_shape
        self.wire_dtype, self.device, self.autocast = wire_dtype, device, autocast
        first = module
        while True:  # the first leaf layer (through compiled segments and nested Sequentials)
            first = getattr(first, "_orig_mod", first)
            child = next(iter(first.children()), None)
            if child is None:
                break
            first = child
        if prev is not None and getattr(first, "inplace", False):
            first.inplace = False  # the received activation is a leaf that needs its gradient

    profile = False  # when True, time spent blocked in receives is measured (synchronising the device)

    def _exchange(self, pending: list, recv: Optional[tuple[tuple[int, ...], int]], res: StepResult):
        """Post the ``pending`` sends together with this action's receive (``(shape, source rank)``, or
        None) as one batch (``comm.exchange``); returns the received tensor. The sends' handles go to
        ``res.sends``."""
        if not pending and recv is None:
            return None
        spec = None if recv is None else (recv[0], self.wire_dtype, recv[1])
        if self.profile:
            sync_device(self.device)
            t = time.perf_counter()
        buf, works = comm.exchange(pending, spec, self.device, self.group)
        if self.profile:
            sync_device(self.device)
            res.wait_s += time.perf_counter() - t
        res.sends.extend(works)
        pending.clear()
        return buf

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return self.module(x)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return self.module(x)

    def run(self, program: Sequence[Action], inputs: Callable[[int], torch.Tensor],
            labels: Callable[[int], torch.Tensor], mb_sizes: list[int], global_count: int,
            before_last_backward: Callable[[], None], train: bool = True,
            before_forward: Optional[Callable[[int], None]] = None) -> StepResult:
        """Run ``program`` (all F and B actions of this stage; only F when ``train`` is False).

        ``inputs(m)`` gives micro-batch m's images (first stage), ``labels(m)`` its labels (last
        stage). Returns the last stage's loss sum and correct count; raises what the model raises.
        """
        res = StepResult(samples=sum(mb_sizes))
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        saved: dict[int, tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        last_b = max((i for i, a in enumerate(program) if a.kind == "B"), default=-1)
        # Sends of one action are posted with the next action's receive, as one batch (see
        # comm.exchange): an action ends with its send and the next begins with its receive, so
        # nothing runs in between and no send is delayed.
        pending: list[tuple[torch.Tensor, int]] = []
        for i, a in enumerate(program):
            m, n = a.microbatch, mb_sizes[a.microbatch]
            # Release sends that have completed (and their buffers), so held activations stay bounded
            # by the schedule's in-flight count rather than growing over the step. (Not while a CUDA
            # graph captures the step: nothing has run yet, and querying a captured send is an error.)
            if not capturing:
                res.sends = [w for w in res.sends if not w.is_completed()]
            if a.kind == "F":
                if before_forward is not None:
                    before_forward(m)
                if self.prev is None:
                    x, x_in = inputs(m), None
                    self._exchange(pending, None, res)
                else:
                    x_in = self._exchange(pending, ((n, *self.in_shape), self.prev), res)
                    x = x_in.requires_grad_(train)
                with torch.set_grad_enabled(train):
                    out = self._forward(x)
                    if self.next is None:
                        logits = out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
                        y = to_device(labels(m), self.device)
                        loss = nn.functional.cross_entropy(logits, y, reduction="sum")
                        res.loss_sum = res.loss_sum + loss.detach()
                        res.correct = res.correct + (logits.detach().argmax(1) == y).sum()
                        out = loss / global_count
                if self.next is not None:
                    pending.append((out.detach().to(self.wire_dtype), self.next))
                if train:
                    saved[m] = (x_in, out)
            else:
                x_in, out = saved.pop(m)
                if i == last_b:
                    before_last_backward()
                if self.next is None:
                    self._exchange(pending, None, res)
                    out.backward()
                else:
                    g = self._exchange(pending, ((n, *self.out_shape), self.next), res)
                    out.backward(g.to(out.dtype))
                if self.prev is not None:
                    assert x_in is not None and x_in.grad is not None
                    pending.append((x_in.grad.to(self.wire_dtype), self.prev))
        self._exchange(pending, None, res)
        for w in res.sends:
            w.wait()
        res.sends.clear()
        return res


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without a stream synchronisation (a copy from pageable memory would
    wait for all queued work first): through pinned memory, asynchronously."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

"""Pipeline parallelism: cut the flat layer list into stages, run a stage's program of micro-batches.

Stages are contiguous runs of layers (GPipe, Huang et al. 2019, section 2.2). ``balance`` cuts them
so that the largest stage cost is smallest (cost per layer: forward FLOPs from
``torch.utils.flop_counter``, or parameter count). A stage runs its program from ``rayconv.schedule``
(GPipe or 1F1B): F(m) receives the activation of micro-batch m from the previous stage (or reads
it from the data), runs the stage, and sends the output on (non-blocking); B(m) receives the output
gradient from the next stage (or starts from the loss), runs backward and sends the input gradient
back. What is sent and received when is the schedule's exchange plan (``schedule.exchange_plan``):
a send is posted together with the next action's receive as one NCCL group (``comm.exchange``), so
crossing sends of 1F1B cannot deadlock; interleaved 1F1B (several model chunks per stage) exchanges
as Megatron-LM does; and neighbours' groups mirror each other (a group NCCL cannot complete until
its peer posts the mirror image is split). ``schedule.check_exchanges`` replays these batches under
NCCL's rules, unbuffered, for every schedule ``make_plan`` accepts. Gradients accumulate over
micro-batches; the loss of each micro-batch is its per-sample sum divided by the global batch size,
so the accumulated gradient is the single-device one. Batch norm normalises each micro-batch by its own
statistics; its running statistics advance once per step (``batchnorm.py``).

Legend: N micro-batch size, C channels, H, W height, width; ``x_NCHW`` an activation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from rayconv.parallel.pipeline.validate import Action, Post
from rayconv.parallel import comm
from rayconv.errors import PlanError


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
        raise PlanError(f"--stages {spec!r} gives {len(cuts) + 1} stages but --pp (times --virtual-stages) is "
                        f"{num_stages}: give {num_stages - 1} cut point(s)")
    edges = [0, *cuts, num_layers]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise PlanError(f"--stages {spec!r}: cut points must increase strictly within 1..{num_layers - 1}")
    return list(zip(edges, edges[1:]))


@dataclass
class StepResult:
    # Kept on the device (no synchronisation inside the step); read with float()/int() when needed.
    loss_sum: object = 0.0    # sum of per-sample losses over this replica's samples (last stage only)
    correct: object = 0       # correctly classified samples (last stage only)
    correct5: object = None   # samples whose label is among the 5 highest logits (evaluation, >= 5 classes)
    wait_s: Optional[float] = 0.0  # seconds blocked in receives (measured only when profiling eagerly)
    samples: int = 0          # samples this replica saw
    sends: list = field(default_factory=list)


@dataclass
class Chunk:
    """One model chunk a stage runs: ``module``; the global ranks holding the previous and next virtual
    stages (None at the ends of the pipeline); per-sample shapes of what it receives from ``prev`` and
    sends to ``next``. A stage holds one chunk, or several under interleaved 1F1B."""

    module: nn.Module
    prev: Optional[int]
    next: Optional[int]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


class StageRunner:
    """Runs one pipeline stage's program for one step.

    ``chunks`` are this stage's model chunks (``Action.chunk`` indexes them); ``wire_dtype`` is the
    dtype on the wire.
    """

    def __init__(self, chunks: Sequence[Chunk], group: Optional[dist.ProcessGroup], wire_dtype: torch.dtype,
                 device: torch.device, autocast: Optional[torch.dtype]):
        self.chunks, self.group = list(chunks), group
        self.wire_dtype, self.device, self.autocast = wire_dtype, device, autocast
        for c in self.chunks:
            first = c.module
            while True:  # the first leaf layer (through compiled segments and nested Sequentials)
                first = getattr(first, "_orig_mod", first)
                child = next(iter(first.children()), None)
                if child is None:
                    break
                first = child
            if c.prev is not None and getattr(first, "inplace", False):
                first.inplace = False  # the received activation is a leaf that needs its gradient

    profile = False  # when True, time spent blocked in receives is measured (synchronising the device)

    def _post(self, post: Post, program: Sequence[Action], mb_sizes: list[int], outbox: dict, inbox: dict,
              res: StepResult) -> None:
        """Post one batch of the step's exchange plan (``schedule.exchange_plan``): the outputs of the
        actions in ``post.sends`` (from ``outbox``) and the inputs of those in ``post.recvs`` (into
        ``inbox``), as one batch (``comm.exchange``), waiting for the receives. The sends' handles go
        to ``res.sends``."""
        specs = []
        for j in post.recvs:
            a = program[j]
            c, n = self.chunks[a.chunk], mb_sizes[a.microbatch]
            specs.append(((n, *c.in_shape), self.wire_dtype, c.prev) if a.kind == "F"
                         else ((n, *c.out_shape), self.wire_dtype, c.next))
        if self.profile:
            comm.sync_device(self.device)
            t = time.perf_counter()
        bufs, works = comm.exchange([outbox.pop(j) for j in post.sends], specs, self.device, self.group)
        if self.profile:
            comm.sync_device(self.device)
            res.wait_s += time.perf_counter() - t
        res.sends.extend(works)
        inbox.update(zip(post.recvs, bufs))

    def _forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return module(x)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return module(x)

    def run(self, program: Sequence[Action], plan: Sequence[Sequence[Post]], inputs: Callable[[int], torch.Tensor],
            labels: Callable[[int], torch.Tensor], mb_sizes: list[int], global_count: int,
            before_last_backward: Callable[[], None], train: bool = True,
            before_forward: Optional[Callable[[int], None]] = None) -> StepResult:
        """Run ``program`` (all F and B actions of this stage; only F when ``train`` is False), posting
        the batches of ``plan[i]`` (``schedule.exchange_plan`` of the program), in order, before action
        ``i`` and those of the last entry after the program.

        ``inputs(m)`` gives micro-batch m's images (first virtual stage), ``labels(m)`` its labels (last
        virtual stage). Returns the last stage's loss sum and correct count; raises what the model raises.
        """
        res = StepResult(samples=sum(mb_sizes))
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        outbox: dict[int, tuple[torch.Tensor, int]] = {}  # action index -> (output to send, destination)
        inbox: dict[int, torch.Tensor] = {}                # action index -> its received input
        last_b = max((i for i, a in enumerate(program) if a.kind == "B"), default=-1)
        for i, a in enumerate(program):
            m, c = a.microbatch, self.chunks[a.chunk]
            # Release sends that have completed (and their buffers), so held activations stay bounded
            # by the schedule's in-flight count rather than growing over the step. (Not while a CUDA
            # graph captures the step: nothing has run yet, and querying a captured send is an error.)
            if not capturing:
                res.sends = [w for w in res.sends if not w.is_completed()]
            for post in plan[i]:
                self._post(post, program, mb_sizes, outbox, inbox, res)
            if a.kind == "F":
                if before_forward is not None:
                    before_forward(m)
                if c.prev is None:
                    x, x_in = inputs(m), None
                else:
                    x_in = inbox.pop(i)
                    x = x_in.requires_grad_(train)
                with torch.set_grad_enabled(train):
                    out = self._forward(c.module, x)
                    if c.next is None:
                        logits = out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
                        y = to_device(labels(m), self.device)
                        loss = nn.functional.cross_entropy(logits, y, reduction="sum")
                        res.loss_sum = res.loss_sum + loss.detach()
                        res.correct = res.correct + (logits.detach().argmax(1) == y).sum()
                        if not train and logits.shape[1] >= 5:  # top-5 (evaluation only)
                            top5 = (logits.detach().topk(5, 1).indices == y[:, None]).any(1).sum()
                            res.correct5 = top5 if res.correct5 is None else res.correct5 + top5
                        out = loss / global_count
                if c.next is not None:
                    outbox[i] = (out.detach().to(self.wire_dtype), c.next)
                if train:
                    saved[(m, a.chunk)] = (x_in, out)
            else:
                x_in, out = saved.pop((m, a.chunk))
                if i == last_b:
                    before_last_backward()
                if c.next is None:
                    out.backward()
                else:
                    g = inbox.pop(i)
                    out.backward(g.to(out.dtype))
                if c.prev is not None:
                    assert x_in is not None and x_in.grad is not None
                    outbox[i] = (x_in.grad.to(self.wire_dtype), c.prev)
        for post in plan[len(program)]:
            self._post(post, program, mb_sizes, outbox, inbox, res)
        assert not outbox and not inbox, "exchange plan left messages unsent or unused"
        for w in res.sends:
            w.wait()
        res.sends.clear()
        return res


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without a stream synchronisation (a copy from pageable memory would
    wait for all queued work first): through pinned memory, asynchronously."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

"""The pipeline stage: run one stage's program of micro-batches for one step.

A stage runs its program (``schedules``: GPipe, 1F1B or interleaved 1F1B): F(m) receives the
activation of micro-batch m from the previous stage (or reads it from the data), runs the stage, and
sends the output on (non-blocking); B(m) receives the output gradient from the next stage (or starts
from the loss), runs backward and sends the input gradient back. What is sent and received when is the
schedule's p2p posts (``p2p.p2p_posts``): a send is posted together with the next action's
receive as one NCCL group (``comm.exchange``), so crossing sends of 1F1B cannot deadlock; interleaved
1F1B (several model chunks per stage) exchanges as Megatron-LM does; and neighbours' groups mirror each
other (a group NCCL cannot complete until its peer posts the mirror image is split).
``checks.check_exchanges`` replays these batches under NCCL's rules, unbuffered, for every schedule
``routing.make_routing`` accepts. Gradients accumulate over micro-batches; the last virtual stage's
output goes to the caller's ``loss`` (``actor/loss.py``), whose value it back-propagates. Batch norm
normalises each micro-batch by its own statistics; its running statistics advance once per step
(``parallel/batchnorm.py``).

Legend: N micro-batch size, C channels, H, W height, width; ``x_NCHW`` an activation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from rayconv.parallel import comm
from rayconv.parallel.pipeline.p2p import Post
from rayconv.parallel.pipeline.schedules import Action


@dataclass
class StepResult:
    """What a stage's run leaves beside its gradients (the loss and its metrics stay with the caller's
    ``loss``)."""

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
        """Post one batch of the step's p2p posts (``p2p.p2p_posts``): the outputs of the
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

    def run(self, program: Sequence[Action], posts: Sequence[Sequence[Post]],
            inputs: Callable[[int], torch.Tensor], loss: Callable[[int, torch.Tensor], torch.Tensor],
            mb_sizes: list[int], before_last_backward: Callable[[], None], train: bool = True,
            before_forward: Optional[Callable[[int], None]] = None) -> StepResult:
        """Run ``program`` (all F and B actions of this stage; only F when ``train`` is False), posting
        the batches of ``posts[i]`` (``p2p.p2p_posts`` of the program), in order, before action
        ``i`` and those of the last entry after the program.

        ``inputs(m)`` gives micro-batch m's images (first virtual stage); ``loss(m, logits_NK)`` the
        scalar to back-propagate from micro-batch m's output (last virtual stage). Raises what the
        model raises.
        """
        res = StepResult(samples=sum(mb_sizes))
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        outbox: dict[int, tuple[torch.Tensor, int]] = {}  # action index -> (output to send, destination)
        inbox: dict[int, torch.Tensor] = {}                # action index -> its received input
        last_b = max((i for i, a in enumerate(program) if a.kind == "B"), default=-1)
        for i, a in enumerate(program):
            # Release sends that have completed (and their buffers), so held activations stay bounded
            # by the schedule's in-flight count rather than growing over the step. (Not while a CUDA
            # graph captures the step: nothing has run yet, and querying a captured send is an error.)
            if not capturing:
                res.sends = [w for w in res.sends if not w.is_completed()]
            for post in posts[i]:
                self._post(post, program, mb_sizes, outbox, inbox, res)
            if a.kind == "F":
                if before_forward is not None:
                    before_forward(a.microbatch)
                self._run_forward(i, a, inputs, loss, train, outbox, inbox, saved)
            else:
                if i == last_b:
                    before_last_backward()
                self._run_backward(i, a, outbox, inbox, saved)
        for post in posts[len(program)]:
            self._post(post, program, mb_sizes, outbox, inbox, res)
        assert not outbox and not inbox, "p2p posts left messages unsent or unused"
        for w in res.sends:
            w.wait()
        res.sends.clear()
        return res

    def _run_forward(self, i: int, a: Action, inputs: Callable[[int], torch.Tensor],
                     loss: Callable[[int, torch.Tensor], torch.Tensor], train: bool, outbox: dict,
                     inbox: dict, saved: dict) -> None:
        """F(m) of chunk ``a.chunk``: its input (the data, or received), the chunk, then the loss (last
        virtual stage) or the output into ``outbox``; input and output kept in ``saved`` for B(m)."""
        m, c = a.microbatch, self.chunks[a.chunk]
        if c.prev is None:
            x, x_in = inputs(m), None
        else:
            x_in = inbox.pop(i)
            x = x_in.requires_grad_(train)
        with torch.set_grad_enabled(train):
            out = self._forward(c.module, x)
            if c.next is None:
                out = loss(m, out)
        if c.next is not None:
            outbox[i] = (out.detach().to(self.wire_dtype), c.next)
        if train:
            saved[(m, a.chunk)] = (x_in, out)

    def _run_backward(self, i: int, a: Action, outbox: dict, inbox: dict, saved: dict) -> None:
        """B(m) of chunk ``a.chunk``: backward from the loss or the received output gradient; the input
        gradient into ``outbox`` for the previous virtual stage."""
        c = self.chunks[a.chunk]
        x_in, out = saved.pop((a.microbatch, a.chunk))
        if c.next is None:
            out.backward()
        else:
            g = inbox.pop(i)
            out.backward(g.to(out.dtype))
        if c.prev is not None:
            assert x_in is not None and x_in.grad is not None
            outbox[i] = (x_in.grad.to(self.wire_dtype), c.prev)

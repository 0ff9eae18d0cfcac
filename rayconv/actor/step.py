"""One actor's training step, in the order it runs (``train_step``): this step's batches, the dropout
seeds, forward and backward through the pipeline schedule, the gradient all-reduce, the recipe (loss
scale, clipping, LARS), the optimizer step, the batch-norm commit, the moving average, the metrics. The
part from the forward pass to the batch-norm commit (``forward_backward_update``) is what a CUDA graph
captures and replays (``cuda_graph.StepGraph``). Also ``flush`` (the last step's metrics) and
``evaluate``. Which micro-batches a step reads is ``batches.py``'s; its loss is ``loss.py``'s; the state
it reads is ``build.ActorState``.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Optional

import torch

from rayconv.actor.batches import MicroBatches
from rayconv.actor.build import ActorState
from rayconv.actor.cuda_graph import sgd_step
from rayconv.actor.loss import StepLoss
from rayconv.actor.report import materialise, report_gauges
from rayconv.actor.steptime import StepClock
from rayconv.data.source import stable_seed
from rayconv.parallel import comm
from rayconv.parallel.batchnorm import commit_batchnorm
from rayconv.parallel.comm import sync_device
from rayconv.parallel.data_parallel import broadcast_modules
from rayconv.parallel.pipeline.p2p import p2p_posts
from rayconv.parallel.pipeline.runner import StepResult
from rayconv.parallel.pipeline.schedules import forward_only
from rayconv.parallel.segments import fix_shapes


def train_step(a: ActorState, step: int, lr: float, profile: bool, t0: float) -> Optional[dict[str, Any]]:
    """Launch one synchronous SGD step (``step`` counts from 0 over the run; ``lr`` for this step;
    ``t0``: perf_counter seconds when the actor's call began).

    The device is not waited for: the call returns the metrics of the *previous* step (None for
    the first), whose values are ready by now, so the GPU never idles between steps while the
    driver's call travels (``flush`` returns the last step's). With ``profile`` the step is
    synchronised and split into compute, receive wait and gradient all-reduce wait (ms); under CUDA
    graphs a step cannot be split, and counts as compute (the waits are None). A profiled step also
    reports ``comm_bytes``: the bytes this actor handed to torch.distributed in the step (sends and
    collectives' inputs, as ``parallel/comm.py`` defines them; a replayed CUDA graph step repeats the
    captured step's, counted when it was captured). Under ``--precision fp16`` the metrics carry
    ``loss_scale`` (the factor the step's loss was multiplied by; None otherwise) and ``skipped``
    (True when an overflow anywhere in the mesh skipped the update; False without fp16).
    Raises what the model or the data raise.
    """
    idle_ms = (t0 - a.last_return) * 1e3 if a.last_return is not None else None
    clock = StepClock(a.device)  # this step's own time and input stall (steptime.py)
    clock.start()
    # 1. This step's batches (its shapes decide whether a captured step replays).
    epoch, replica_idx = a.batches.train_indices(step)
    global_count = sum(len(r) for r in replica_idx)
    key = tuple(len(r) for r in replica_idx)  # what fixes a captured step's shapes
    graph = a.step_graph
    # A profiled step runs eagerly, also where steps replay a CUDA graph, so that its waits can be timed.
    graphed = graph is not None and not profile and graph.will_replay(key)
    mb = a.batches.train(epoch, replica_idx, a.routing.schedule.num_microbatches, clock,
                         graph if graphed else None)
    # 2. Dropout seeds and the learning rate.
    generators = seed(a, step)
    if not a.train_mode:   # (train() walks every module: at the first step and after an evaluation only)
        a.part.train()
        a.train_mode = True
    for g in a.optimizer.param_groups:
        g["lr"] = lr
    for t in a.lr_t.values():
        t.fill_(lr)
    loss_scale = a.recipe.loss_scale
    # 3-7. Forward/backward, all-reduce, recipe, update, batch-norm commit: eagerly, or the graph's replay.
    allreduce: dict[str, float] = {}
    one_step = functools.partial(forward_backward_update, a, step, mb, global_count, profile, allreduce)
    a.runner.profile = profile
    comm.time_exchanges(profile, a.device)
    if profile:
        sync_device(a.device)
    t_run = time.perf_counter()
    replayed = False
    if graph is not None and not profile:
        # Warm-up steps and steps of another shape run eagerly; the rest replay one captured step.
        res, loss = graph.run(key, one_step, generators)
        res.wait_s = None  # (receive and all-reduce waits are not separable inside a captured step)
        replayed = graph.replayed
    elif graph is not None:
        res, loss = graph.eager(one_step)
    else:
        res, loss = one_step()
    a.batches.announce_next(step)   # (at an epoch's end: the next epoch read while this step computes)
    exchange_s = comm.exposed_s()
    comm.time_exchanges(False)
    if a.compiled and not a.shapes_fixed and key == a.full_batch:
        fix_shapes(c.module for c in a.runner.chunks)   # (a partial batch or evaluation: eager from now on)
        a.shapes_fixed = True
    if not replayed:   # (a replay leaves every .grad None, as the zero_grad after the capture did)
        a.optimizer.zero_grad(set_to_none=True)
    # 8. The moving average (eager, outside any captured step).
    a.recipe.after_update(a.part, step)
    # 9. The metrics; those of the previous step are returned.
    current = {"loss_scale": loss_scale, "skipped": a.recipe.skipped, "rank": a.rank, "step": step,
               "reports": a.reports, "loss_sum": loss.loss_sum, "correct": loss.correct,
               "samples": global_count if a.per_layer else sum(mb.sizes), "global_count": global_count,
               "epoch": epoch, "idle_ms": idle_ms,
               "graph_capture_s": graph.take_capture_s() if graph is not None else None,
               "interval_ms": (t0 - a.last_start) * 1e3 if a.last_start is not None else None}
    a.last_start = t0
    if profile:
        current.update(_profile_split(a, res, t_run, allreduce.get("s"), exchange_s))
    _hold_scalars(a, current, loss, clock.stream)
    clock.end()
    current["clock"] = clock
    previous, a.pending = a.pending, current
    out = materialise(previous)
    report_gauges(a, out)
    return out


def forward_backward_update(a: ActorState, step: int, mb: MicroBatches, global_count: int, profile: bool,
                            allreduce: dict[str, float]) -> tuple[StepResult, StepLoss]:
    """The captured part of step ``step``: forward and backward of every micro-batch through the
    stage's schedule, the gradient all-reduce, the recipe (fp16 unscale and overflow agreement,
    clipping, LARS: ``recipe.py``), the update unless an overflow skips it (from the device learning
    rate under CUDA graphs), then the batch-norm buffers (committed also on a skipped step: the
    forward passes ran, as torch's batch norm would have counted them). Returns (the runner's result,
    the loss). With ``profile`` (eagerly: nothing may synchronise inside a graph capture) the step is
    synchronised around the all-reduce to time it (``allreduce["s"]``)."""
    comm.reset_volume()
    loss = StepLoss(mb.labels, global_count, label_smoothing=a.cfg.label_smoothing, scale=a.recipe.loss_scale)
    res = a.runner.run(a.program, a.p2p_posts, mb.inputs, loss, mb.sizes, a.sync.arm,
                       before_forward=mb.before_forward)
    if profile:
        sync_device(a.device)
    t_sync = time.perf_counter()
    a.sync.finish()
    if profile:
        sync_device(a.device)
        allreduce["s"] = time.perf_counter() - t_sync if a.sync.group is not None else 0.0
    if not a.recipe.before_update(step):
        if a.step_graph is not None:
            sgd_step(a.optimizer, a.lr_t)
        else:
            a.optimizer.step()
    commit_batchnorm(a.parallel.deferred_bn)  # (once per step, after the last micro-batch)
    if a.parallel.has_buffers and not a.cfg.sync_batchnorm:
        # Per-replica batch-norm statistics (as DDP): running stats follow dp replica 0.
        broadcast_modules(a.parallel.replicated, a.groups.ranks["dp"][0], a.groups.axis["dp"],
                          buffers_only=True)
    if a.device.type == "cuda":
        loss.held = loss.pair()   # (inside a captured step: a replay leaves the step's scalars ready)
    # (a replay does not run this function: it repeats the captured step's communication)
    a.comm_bytes = sum(comm.volume().values())
    return res, loss


def seed(a: ActorState, step: int) -> list[torch.Generator]:
    """Seed this step's dropout; returns the sliced dropouts' generators (a CUDA graph registers them).

    Each (replica, stage) has its own stream, the same on the actors of its filter split; sliced
    dropouts draw full-width masks from a generator shared by all actors of the split (all actors
    of the run for the per-layer plan's FC part), one stream per layer. (A CUDA graph replay reads
    the generators' seeds as set here.)"""
    s = stable_seed(a.cfg.seed, step, a.coord.dp, a.coord.pp)
    torch.default_generator.manual_seed(s)  # (torch.manual_seed would also seed every visible GPU)
    if a.device.type == "cuda":
        torch.cuda.default_generators[a.device.index].manual_seed(s)
    split_key = "fc" if a.per_layer else a.coord.dp
    generators = []
    for name, mod in a.sliced_dropouts:
        mod.reseed(stable_seed(a.cfg.seed, step, split_key, a.coord.pp, name), a.device)
        generators.append(mod.generator)
    return generators


def _profile_split(a: ActorState, res: StepResult, t_run: float, allreduce_s: Optional[float],
                   exchange_s: float) -> dict[str, Any]:
    """A profiled step's split (ms): compute, receive wait, all-reduce wait, exchanges; and its bytes."""
    sync_device(a.device)
    total = time.perf_counter() - t_run
    wait_s, ar_s = res.wait_s or 0.0, allreduce_s or 0.0
    return dict(comm_bytes=a.comm_bytes, step_actor_ms=total * 1e3,
                wait_ms=None if res.wait_s is None else wait_s * 1e3,
                allreduce_ms=None if allreduce_s is None else ar_s * 1e3,
                exchange_ms=exchange_s * 1e3 if a.mesh.fs > 1 or a.per_layer else None,
                compute_ms=(total - wait_s - ar_s - exchange_s) * 1e3)


def _hold_scalars(a: ActorState, current: dict[str, Any], loss: StepLoss, stream: torch.cuda.Stream) -> None:
    """On GPUs, copy the step's scalars (the last stage's; a host number copied to the device would
    synchronise the stream) to pinned host memory behind the step's work on ``stream`` and mark the
    point with an event: reading them later waits for this step only (``.item()`` would wait for
    everything queued on the stream, including the step launched after it)."""
    if a.device.type != "cuda" or not isinstance(loss.loss_sum, torch.Tensor):
        return
    host = torch.empty(2, dtype=torch.float64, pin_memory=True)
    # (made by ``forward_backward_update``, or by the capture a replay repeats)
    host.copy_(loss.held, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    current.update(loss_sum=host[0], correct=host[1], event=event)


def flush(a: ActorState) -> Optional[dict[str, Any]]:
    """The metrics of the last step launched (waits for the device)."""
    previous, a.pending = a.pending, None
    out = materialise(previous)
    report_gauges(a, out, force=True)
    a.last_return = None  # the driver waits on purpose after a flush: not counted as idle
    return out


def evaluate(a: ActorState, split: str = "test") -> dict[str, Any]:
    """Loss sum (unsmoothed cross entropy) and correct counts over this replica's share of the
    held-out set of ``split`` ("test", or "val": --val-split's images of the train split; each sample
    once), with the weights the part holds now."""
    replica_idx = a.batches.test_indices(split)
    per_microbatch = max(1, a.cfg.global_batch_size // a.mesh.dp)
    # The same number of micro-batches on every replica (replica 0's share is the largest): the per-layer
    # plan's batch gather is a collective over all of them.
    n_microbatches = max(1, -(-len(replica_idx[0]) // per_microbatch))
    mb = a.batches.evaluate(replica_idx, n_microbatches, split)
    a.part.eval()
    a.train_mode = False
    sched = forward_only(a.mesh.pp, n_microbatches, a.routing.schedule.virtual_stages)
    count = sum(len(r) for r in replica_idx) if a.per_layer else sum(mb.sizes)
    loss = StepLoss(mb.labels, max(1, count), top5=True)
    a.runner.run(sched.programs[a.coord.pp], p2p_posts(sched, a.coord.pp), mb.inputs, loss,
                 mb.sizes, lambda: None, train=False, before_forward=mb.before_forward)
    return {"reports": a.reports, "loss_sum": float(loss.loss_sum), "correct": int(loss.correct),
            "correct5": None if loss.correct5 is None else int(loss.correct5), "samples": count}

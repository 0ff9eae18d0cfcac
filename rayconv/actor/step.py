"""The step program of an actor: launching one synchronous SGD step (dropout seeds, learning rate, the
stage runner, gradient all-reduce, loss scaling and clipping, the update, the moving average, two
steps in flight), ``train_steps``, ``trace``, ``flush``, ``evaluate`` and the loss scale's test hook. Which micro-batches a step reads is ``batches.py``'s; its loss is
``loss.py``'s. ``StepMixin`` is inherited by ``rayconv/actor/worker.py``'s ``Worker``; it reads what
``BuildMixin.setup`` built.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile as torch_profile

from rayconv.actor.batches import MicroBatches
from rayconv.actor.cuda_graph import sgd_step
from rayconv.actor.loss import StepLoss
from rayconv.actor.report import materialise
from rayconv.actor.steptime import StepClock
from rayconv.data.source import stable_seed
from rayconv.parallel import comm
from rayconv.parallel.batchnorm import commit_batchnorm
from rayconv.parallel.comm import sync_device
from rayconv.parallel.data_parallel import broadcast_modules
from rayconv.parallel.filter_split.layers import ShardedDropout
from rayconv.parallel.pipeline.p2p import exchange_plan
from rayconv.parallel.pipeline.runner import StepResult
from rayconv.parallel.pipeline.schedules import forward_only


class StepMixin:
    """The per-step calls of ``Worker``: ``train_step``, ``train_steps``, ``trace``, ``flush``, ``evaluate``."""

    def train_step(self, step: int, lr: float, profile: bool = False) -> Optional[dict[str, Any]]:
        """Launch one synchronous SGD step (``step`` counts from 0 over the run; ``lr`` for this step).

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
        t0 = time.perf_counter()
        idle_ms = (t0 - self.last_return) * 1e3 if self.last_return is not None else None
        out = self._launch_step(step, lr, profile, t0, idle_ms)
        # (after the step's locals, its autograd graph among them, are freed: that is the actor's
        # time, not time spent waiting for the driver's next call)
        self.last_return = time.perf_counter()
        return out

    def _launch_step(self, step: int, lr: float, profile: bool, t0: float,
                     idle_ms: Optional[float]) -> Optional[dict[str, Any]]:
        self.clock = clock = StepClock(self.device)  # this step's own time and input stall (steptime.py)
        clock.start()
        epoch, replica_idx = self.batches.train_indices(step)
        global_count = sum(len(r) for r in replica_idx)
        key = tuple(len(r) for r in replica_idx)  # what fixes a captured step's shapes
        graph = self.step_graph
        # A profiled step runs eagerly, also where steps replay a CUDA graph, so that its waits can be timed.
        graphed = graph is not None and not profile and graph.will_replay(key)
        mb = self.batches.train(epoch, replica_idx, self.plan.schedule.num_microbatches, clock,
                                graph if graphed else None)
        generators = self._seed(step)
        self.part.train()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        for t in self.lr_t.values():
            t.fill_(lr)
        loss_scale = self.recipe.loss_scale
        res, loss, t_run, allreduce_s, exchange_s = self._run_sgd(step, mb, global_count, key, generators, profile)
        self.recipe.after_update(self.part, step)  # the moving average (eager, outside any captured step)
        current = {"loss_scale": loss_scale, "skipped": self.recipe.skipped, "rank": self.rank, "step": step, "reports": self.reports, "loss_sum": loss.loss_sum,
                   "correct": loss.correct, "samples": global_count if self.per_layer else sum(mb.sizes),
                   "global_count": global_count, "epoch": epoch, "idle_ms": idle_ms,
                   "interval_ms": (t0 - self.last_start) * 1e3 if self.last_start is not None else None}
        self.last_start = t0
        if profile:
            current.update(self._profile_split(res, t_run, allreduce_s, exchange_s))
        self._hold_scalars(current, loss)
        clock.end()
        current["clock"] = clock
        previous, self.pending = self.pending, current
        out = materialise(previous)
        self._report(out)
        return out

    def _seed(self, step: int) -> list[torch.Generator]:
        """Seed this step's dropout; returns the sharded dropouts' generators (a CUDA graph registers them).

        Each (replica, stage) has its own stream, the same on the actors of its filter split; sharded
        dropouts draw full-width masks from a generator shared by all actors of the split (all actors
        of the run for the per-layer plan's FC part), one stream per layer. (A CUDA graph replay reads
        the generators' seeds as set here.)"""
        seed = stable_seed(self.cfg.seed, step, self.coord.dp, self.coord.pp)
        torch.default_generator.manual_seed(seed)  # (torch.manual_seed would also seed every visible GPU)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(seed)
        split_key = "fc" if self.per_layer else self.coord.dp
        generators = []
        for name, mod in self.part.named_modules():
            if isinstance(mod, ShardedDropout):
                mod.reseed(stable_seed(self.cfg.seed, step, split_key, self.coord.pp, name), self.device)
                generators.append(mod.generator)
        return generators

    def _run_sgd(self, step: int, mb: MicroBatches, global_count: int, key: tuple[int, ...], generators: list[torch.Generator],
                 profile: bool) -> tuple[StepResult, StepLoss, float, Optional[float], float]:
        """Forward, backward, all-reduce and update of step ``step``: eagerly, or the CUDA graph's replay.
        Returns (the runner's result, the loss, perf_counter at the start, all-reduce wait s or None,
        exposed filter-split exchange s). With ``profile``, the step is synchronised around the
        all-reduce and every activation exchange of filter split to time them apart (eagerly: nothing
        may synchronise inside a graph capture)."""
        allreduce: dict[str, float] = {}

        def sgd() -> tuple[StepResult, StepLoss]:
            comm.reset_volume()
            loss = StepLoss(mb.labels, global_count, label_smoothing=self.cfg.label_smoothing,
                            scale=self.recipe.loss_scale)
            res = self.runner.run(self.program, self.exchange_plan, mb.inputs, loss, mb.sizes, self.sync.arm,
                                  before_forward=mb.before_forward)
            if profile:
                sync_device(self.device)
            t_sync = time.perf_counter()
            self.sync.finish()
            if profile:
                sync_device(self.device)
                allreduce["s"] = time.perf_counter() - t_sync if self.sync.group is not None else 0.0
            self._update(step)
            # (a replay does not run this function: it repeats the captured step's communication)
            self.comm_bytes = sum(comm.volume().values())
            return res, loss

        graph = self.step_graph
        self.runner.profile = profile
        comm.time_exchanges(profile, self.device)
        if profile:
            sync_device(self.device)
        t_run = time.perf_counter()
        if graph is not None and not profile:
            # Warm-up steps and steps of another shape run eagerly; the rest replay one captured step.
            res, loss = graph.run(key, sgd, generators)
            res.wait_s = None  # (receive and all-reduce waits are not separable inside a captured step)
        elif graph is not None:
            res, loss = graph.eager(sgd)
        else:
            res, loss = sgd()
        exchange_s = comm.exposed_s()
        comm.time_exchanges(False)
        self.optimizer.zero_grad(set_to_none=True)
        return res, loss, t_run, allreduce.get("s"), exchange_s

    def _profile_split(self, res: StepResult, t_run: float, allreduce_s: Optional[float],
                       exchange_s: float) -> dict[str, Any]:
        """A profiled step's split (ms): compute, receive wait, all-reduce wait, exchanges; and its bytes."""
        sync_device(self.device)
        total = time.perf_counter() - t_run
        wait_s, ar_s = res.wait_s or 0.0, allreduce_s or 0.0
        return dict(comm_bytes=self.comm_bytes, step_actor_ms=total * 1e3,
                    wait_ms=None if res.wait_s is None else wait_s * 1e3,
                    allreduce_ms=None if allreduce_s is None else ar_s * 1e3,
                    exchange_ms=exchange_s * 1e3 if self.mesh.fs > 1 or self.per_layer else None,
                    compute_ms=(total - wait_s - ar_s - exchange_s) * 1e3)

    def _hold_scalars(self, current: dict[str, Any], loss: StepLoss) -> None:
        """On GPUs, copy the step's scalars (the last stage's; a host number copied to the device would
        synchronise the stream) to pinned host memory behind the step's work and mark the point with an
        event: reading them later waits for this step only (``.item()`` would wait for everything queued
        on the stream, including the step launched after it)."""
        if self.device.type != "cuda" or not isinstance(loss.loss_sum, torch.Tensor):
            return
        vals = torch.stack([loss.loss_sum.to(torch.float64), torch.as_tensor(loss.correct).to(torch.float64)])
        host = torch.empty(2, dtype=torch.float64, pin_memory=True)
        host.copy_(vals, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        current.update(loss_sum=host[0], correct=host[1], event=event)

    def _update(self, step: int) -> None:
        """Loss-scale agreement and clipping (``recipe.py``), the update unless an overflow skips it
        (from the device learning rate under CUDA graphs), then batch-norm buffers (committed also on
        a skipped step: the forward passes ran, as torch's batch norm would have counted them)."""
        if not self.recipe.before_update(step):
            if self.step_graph is not None:
                sgd_step(self.optimizer, self.lr_t)
            else:
                self.optimizer.step()
        commit_batchnorm(self.parallel.deferred_bn)  # (once per step, after the last micro-batch)
        if self.parallel.has_buffers and not self.cfg.sync_batchnorm:
            # Per-replica batch-norm statistics (as DDP): running stats follow dp replica 0.
            broadcast_modules(self.parallel.replicated, self.groups.ranks["dp"][0], self.groups.axis["dp"],
                              buffers_only=True)

    def trace(self, first_step: int, steps: int, lr: float) -> dict[str, Any]:
        """Run ``steps`` steps under torch.profiler, then ``steps`` more under cProfile. Returns the wall
        time (ms) of the first ``steps``, the summed device kernel time (ms; NCCL kernels overlap compute,
        so it may exceed the wall time) and, as text, the profiler's table of the most expensive operators
        (self device time on GPUs, self CPU time otherwise) and cProfile's of the actor's Python functions."""
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.flush()
        sync_device(self.device)
        t0 = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            self.train_steps(first_step, steps, lr)
            sync_device(self.device)
        wall_ms = (time.perf_counter() - t0) * 1e3
        # The actor's Python side over as many more steps: where the CPU's time goes when the device waits.
        py = cProfile.Profile()
        py.enable()
        self.train_steps(first_step + steps, steps, lr)
        sync_device(self.device)
        py.disable()
        py_table = io.StringIO()
        pstats.Stats(py, stream=py_table).sort_stats("tottime").print_stats(25)
        events = prof.key_averages()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in events) if cuda else None
        return {"rank": self.rank, "wall_ms": wall_ms, "steps": steps,
                "device_ms": kernel_us / 1e3 if kernel_us is not None else None,
                "table": events.table(sort_by=key, row_limit=30) + "\n\nPython profile (cProfile, "
                f"{steps} more steps, by own time):\n" + py_table.getvalue()}

    def train_steps(self, first_step: int, steps: int, lr: float) -> Optional[dict[str, Any]]:
        """Run ``steps`` steps from ``first_step`` in one call, each exactly as ``train_step`` runs it
        (two in flight), with no driver call between them; returns the last step's metrics (waits for
        the device). The benchmark times this against the driver's loop: the difference is the cost
        of the driver's per-step calls."""
        for s in range(first_step, first_step + steps):
            self.train_step(s, lr)
        return self.flush()

    def flush(self) -> Optional[dict[str, Any]]:
        """The metrics of the last step launched (waits for the device)."""
        previous, self.pending = self.pending, None
        out = materialise(previous)
        self._report(out)
        self.last_return = None  # the driver waits on purpose after a flush: not counted as idle
        return out

    def evaluate(self, ema: bool = False, split: str = "test") -> dict[str, Any]:
        """Loss sum (unsmoothed cross entropy) and correct counts over this replica's share of the
        held-out set (each sample once; ``split`` "val": --val-split's images); ``ema``: of the moving average's weights (--model-ema; the
        model's own are restored after, ``state.py``'s ``weights``). Raises RuntimeError for ``ema`` without --model-ema."""
        with self.weights(ema):
            return self._evaluate(split)

    def _evaluate(self, split: str = "test") -> dict[str, Any]:
        replica_idx = self.batches.test_indices(split)
        chunk = max(1, self.cfg.global_batch_size // self.mesh.dp)
        # The same number of chunks on every replica (replica 0's shard is the largest): the per-layer
        # plan's batch gather is a collective over all of them.
        n_chunks = max(1, -(-len(replica_idx[0]) // chunk))
        mb = self.batches.evaluate(replica_idx, n_chunks, split)
        self.part.eval()
        sched = forward_only(self.mesh.pp, n_chunks, self.plan.schedule.num_chunks)
        count = sum(len(r) for r in replica_idx) if self.per_layer else sum(mb.sizes)
        loss = StepLoss(mb.labels, max(1, count), top5=True)
        self.runner.run(sched.programs[self.coord.pp], exchange_plan(sched, self.coord.pp), mb.inputs, loss,
                        mb.sizes, lambda: None, train=False, before_forward=mb.before_forward)
        return {"reports": self.reports, "loss_sum": float(loss.loss_sum), "correct": int(loss.correct),
                "correct5": None if loss.correct5 is None else int(loss.correct5), "samples": count}

    def inject_overflow(self, step: int) -> None:
        """Test hook: at ``step`` (under --precision fp16), make this actor's first gradient inf after the
        backward pass, as an overflow would (``recipe.StepRecipe.before_update``)."""
        self.recipe.overflow_at = step

    def loss_scale_state(self) -> Optional[dict[str, Any]]:
        """The float16 loss scale's state (``DynamicLossScale.state_dict``) and whether the last step
        was skipped; None without --precision fp16."""
        scaler = self.recipe.scaler
        return None if scaler is None else {**scaler.state_dict(), "skipped": self.recipe.skipped}

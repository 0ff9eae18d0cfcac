"""The step program of an actor: micro-batches from the replicas' sample indices, launching one
synchronous SGD step (dropout seeds, learning rate, the stage runner, gradient all-reduce, the update,
two steps in flight), ``train_steps``, ``trace``, ``flush`` and ``evaluate``. ``StepMixin`` is
inherited by ``rayconv/worker.py``'s ``Worker``; it reads what ``BuildMixin.setup`` built.
"""

from __future__ import annotations

import io
import time
from typing import Any, Optional

import numpy as np
import torch

from rayconv.data import source as data_mod
from rayconv.mesh import split_slices
from rayconv.parallel import comm
from rayconv.parallel.batchnorm import commit_batchnorm
from rayconv.actor.cuda_graph import sgd_step
from rayconv.parallel.data_parallel import broadcast_modules
from rayconv.parallel.filter_split.layers import ShardedDropout
from rayconv.parallel.comm import sync_device
from rayconv.parallel.pipeline.runner import StepResult, to_device
from rayconv.parallel.pipeline.validate import exchange_plan, forward_only
from rayconv.actor.steptime import StepClock
from rayconv.actor.report import materialise


class StepMixin:
    """The per-step calls of ``Worker``: ``train_step``, ``train_steps``, ``trace``, ``flush``, ``evaluate``."""

    def _microbatches(self, split: str, epoch: int, replica_idx: list[np.ndarray], n_mb: int,
                      static: bool = False):
        """Micro-batch sizes and accessors for this actor, from every replica's sample indices.

        Returns (sizes, inputs(m), labels(m), before_forward(m)). Under the per-layer plan the FC
        layers see the whole gathered batch, so labels are those of micro-batch m of every replica.
        With ``static`` (a CUDA graph step) images and labels are copied into the graph's buffers."""
        idx = replica_idx[self.coord.dp]
        slices = split_slices(len(idx), n_mb)
        sizes = [s.stop - s.start for s in slices]
        def load(sub: np.ndarray) -> torch.Tensor:
            x = self.source.images(split, sub, self.device, epoch, dtype=self.input_dtype)
            return x.contiguous(memory_format=torch.channels_last) if self.device.type == "cuda" and x.dim() == 4 else x

        inputs = lambda m: None  # noqa: E731
        if self.is_first and split == "train":
            self.clock.input_begin()  # (the wait for the batch not overlapped with compute: input stall)
            x_all = load(idx)  # the step's batch at once (announced ahead to the loader), sliced
            self.clock.input_end()
            if static:
                x_all = self.step_graph.buffer("images", x_all)
            inputs = lambda m: x_all[slices[m]]  # noqa: E731
        elif self.is_first:
            # Evaluation reads chunk by chunk (the held-out shard can be far larger than a batch).
            self.source.prefetch(split, epoch, [idx[sl] for sl in slices])
            inputs = lambda m: load(idx[slices[m]])  # noqa: E731
        labels = lambda m: None  # noqa: E731
        before_forward = None
        if self.plan_mode:
            per_replica = [split_slices(len(r), n_mb) for r in replica_idx]
            y = [self.source.labels(split, r) for r in replica_idx]
            labels = lambda m: torch.cat([yr[sl[m]] for yr, sl in zip(y, per_replica)])  # noqa: E731
            gather = self.sharded.batch_gather

            def before_forward(m: int) -> None:
                gather.sizes = [sl[m].stop - sl[m].start for sl in per_replica]
        elif self.is_last:
            y_all = self.source.labels(split, idx)
            labels = lambda m: y_all[slices[m]]  # noqa: E731
        if static and (self.plan_mode or self.is_last):
            host = [labels(m) for m in range(n_mb)]
            y_dev = self.step_graph.buffer("labels", to_device(torch.cat(host), self.device))
            views = torch.split(y_dev, [len(h) for h in host])
            labels = lambda m: views[m]  # noqa: E731
        return sizes, inputs, labels, before_forward

    def train_step(self, step: int, lr: float, profile: bool = False) -> Optional[dict[str, Any]]:
        """Launch one synchronous SGD step (``step`` counts from 0 over the run; ``lr`` for this step).

        The device is not waited for: the call returns the metrics of the *previous* step (None for
        the first), whose values are ready by now, so the GPU never idles between steps while the
        driver's call travels (``flush`` returns the last step's). With ``profile`` the step is
        synchronised and split into compute, receive wait and gradient all-reduce wait (ms); under CUDA
        graphs a step cannot be split, and counts as compute (the waits are None). A profiled step also
        reports ``comm_bytes``: the bytes this actor handed to torch.distributed in the step (sends and
        collectives' inputs, as ``parallel/comm.py`` defines them; a replayed CUDA graph step repeats the
        captured step's, counted when it was captured).
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
        epoch, step_in_epoch = divmod(step, self.sharding.steps_per_epoch)
        replica_idx = [self.sharding.replica_batch(epoch, step_in_epoch, r)[0] for r in range(self.mesh.dp)]
        global_count = sum(len(r) for r in replica_idx)
        if self.is_first and (step_in_epoch == 0 or step == self.first_step):
            # Announce the rest of the epoch to the loader so that decoding runs ahead of the steps.
            self.source.prefetch("train", epoch, [
                self.sharding.replica_batch(epoch, s, self.coord.dp)[0]
                for s in range(step_in_epoch, self.sharding.steps_per_epoch)])
        graph = self.step_graph
        key = tuple(len(r) for r in replica_idx)  # what fixes a captured step's shapes
        # A profiled step runs eagerly, also where steps replay a CUDA graph, so that its waits can be timed.
        graphed = graph is not None and not profile and graph.will_replay(key)
        sizes, inputs, labels, before_forward = self._microbatches(
            "train", epoch, replica_idx, self.plan.schedule.num_microbatches, static=graphed)
        # Dropout: each (replica, stage) has its own stream, the same on the actors of its filter split;
        # sharded dropouts draw full-width masks from a generator shared by all actors of the split
        # (all actors of the run for the per-layer plan's FC part), one stream per layer. (A CUDA graph
        # replay reads the generators' seeds as set here.)
        seed = data_mod.stable_seed(self.cfg.seed, step, self.coord.dp, self.coord.pp)
        torch.default_generator.manual_seed(seed)  # (torch.manual_seed would also seed every visible GPU)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(seed)
        split_key = "fc" if self.plan_mode else self.coord.dp
        generators = []
        for name, mod in self.part.named_modules():
            if isinstance(mod, ShardedDropout):
                mod.reseed(data_mod.stable_seed(self.cfg.seed, step, split_key, self.coord.pp, name), self.device)
                generators.append(mod.generator)
        self.part.train()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        for t in self.lr_t.values():
            t.fill_(lr)

        # With ``profile``, the step is synchronised around the all-reduce and every activation exchange
        # of filter split to time them apart (eagerly: nothing may synchronise inside a graph capture).
        timed = profile
        allreduce: dict[str, float] = {}

        def sgd() -> StepResult:
            comm.reset_volume()
            res = self.runner.run(self.program, self.exchange_plan, inputs, labels, sizes, global_count,
                                  self.sync.arm, before_forward=before_forward)
            if timed:
                sync_device(self.device)
            t_sync = time.perf_counter()
            self.sync.finish()
            if timed:
                sync_device(self.device)
                allreduce["s"] = time.perf_counter() - t_sync if self.sync.group is not None else 0.0
            self._update()
            # (a replay does not run this function: it repeats the captured step's communication)
            self.comm_bytes = sum(comm.volume().values())
            return res

        self.runner.profile = timed
        comm.time_exchanges(timed, self.device)
        if profile:
            sync_device(self.device)
        t_run = time.perf_counter()
        if graph is not None and not profile:
            # Warm-up steps and steps of another shape run eagerly; the rest replay one captured step.
            res = graph.run(key, sgd, generators)
            res.wait_s = None  # (receive and all-reduce waits are not separable inside a captured step)
        elif graph is not None:
            res = graph.eager(sgd)
        else:
            res = sgd()
        allreduce_s = allreduce.get("s")
        exchange_s = comm.exposed_s()
        comm.time_exchanges(False)
        self.optimizer.zero_grad(set_to_none=True)
        current = {"rank": self.rank, "step": step, "reports": self.reports, "loss_sum": res.loss_sum,
                   "correct": res.correct, "samples": global_count if self.plan_mode else sum(sizes),
                   "global_count": global_count, "epoch": epoch, "idle_ms": idle_ms,
                   "interval_ms": (t0 - self.last_start) * 1e3 if self.last_start is not None else None}
        self.last_start = t0
        if profile:
            sync_device(self.device)
            total = time.perf_counter() - t_run
            wait_s, ar_s = res.wait_s or 0.0, allreduce_s or 0.0
            current.update(comm_bytes=self.comm_bytes, step_actor_ms=total * 1e3, wait_ms=None if res.wait_s is None else wait_s * 1e3,
                           allreduce_ms=None if allreduce_s is None else ar_s * 1e3,
                           exchange_ms=exchange_s * 1e3 if self.mesh.fs > 1 or self.plan_mode else None,
                           compute_ms=(total - wait_s - ar_s - exchange_s) * 1e3)
        if self.device.type == "cuda" and isinstance(res.loss_sum, torch.Tensor):
            # Copy the step's scalars (the last stage's; a host number copied to the device would
            # synchronise the stream) to pinned host memory behind the step's work and mark the point
            # with an event: reading them later waits for this step only (``.item()`` would wait for
            # everything queued on the stream, including the step launched after it).
            vals = torch.stack([res.loss_sum.to(torch.float64), torch.as_tensor(res.correct).to(torch.float64)])
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            host.copy_(vals, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            current.update(loss_sum=host[0], correct=host[1], event=event)
        clock.end()
        current["clock"] = clock
        previous, self.pending = self.pending, current
        out = materialise(previous)
        self._report(out)
        return out

    def _update(self) -> None:
        """The SGD update (from the device learning rate under CUDA graphs), then batch-norm buffers."""
        if self.step_graph is not None:
            sgd_step(self.optimizer, self.lr_t)
        else:
            self.optimizer.step()
        commit_batchnorm(self.deferred_bn)  # (once per step, after the last micro-batch)
        if self.has_buffers and not self.cfg.sync_batchnorm:
            # Per-replica batch-norm statistics (as DDP): running stats follow dp replica 0.
            broadcast_modules(self.replicated, self.groups.ranks["dp"][0], self.groups.axis["dp"], buffers_only=True)

    def trace(self, first_step: int, steps: int, lr: float) -> dict[str, Any]:
        """Run ``steps`` steps under torch.profiler, then ``steps`` more under cProfile. Returns the wall
        time (ms) of the first ``steps``, the summed device kernel time (ms; NCCL kernels overlap compute,
        so it may exceed the wall time) and, as text, the profiler's table of the most expensive operators
        (self device time on GPUs, self CPU time otherwise) and cProfile's of the actor's Python functions."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.flush()
        sync_device(self.device)
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            self.train_steps(first_step, steps, lr)
            sync_device(self.device)
        wall_ms = (time.perf_counter() - t0) * 1e3
        # The actor's Python side over as many more steps: where the CPU's time goes when the device waits.
        import cProfile
        import pstats

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

    def evaluate(self) -> dict[str, Any]:
        """Loss sum and correct count over this replica's share of the held-out set (each sample once)."""
        replica_idx = [data_mod.test_shard(self.source.test_size, self.mesh.dp, r) for r in range(self.mesh.dp)]
        chunk = max(1, self.cfg.global_batch_size // self.mesh.dp)
        # The same number of chunks on every replica (replica 0's shard is the largest): the plan's
        # batch gather is a collective over all of them.
        n_chunks = max(1, -(-len(replica_idx[0]) // chunk))
        sizes, inputs, labels, before_forward = self._microbatches("test", 0, replica_idx, n_chunks)
        self.part.eval()
        sched = forward_only(self.mesh.pp, n_chunks, self.plan.schedule.num_chunks)
        count = sum(len(r) for r in replica_idx) if self.plan_mode else sum(sizes)
        res = self.runner.run(sched.programs[self.coord.pp], exchange_plan(sched, self.coord.pp), inputs, labels,
                              sizes, max(1, count), lambda: None, train=False, before_forward=before_forward)
        return {"reports": self.reports, "loss_sum": float(res.loss_sum), "correct": int(res.correct),
                "correct5": None if res.correct5 is None else int(res.correct5), "samples": count}

"""The Ray actor: one per device, holding one part of the model (a replica, a stage, a filter shard).

The driver creates the actors (``cluster.py``), sends each its rank and the plan once (``setup``),
then makes one ``train_step`` call per actor per step. Inside the step, the actor reads its own data
shard, runs its stage program, exchanges activations and gradients with its neighbours and all-reduces
gradients with its data-parallel group, all through torch.distributed (``parallel/comm.py``): no
tensor of the training path passes through the driver or the Ray object store.
"""

from __future__ import annotations

import io
import os
import random
import socket
import time
from typing import Any, Optional

import numpy as np
import ray
import torch
from torch import nn

from . import data as data_mod
from .config import Config
from .mesh import Mesh
from .models import run_model, to_layers
from .parallel import comm
from .parallel.batchnorm import DeferredBatchNorm, commit_batchnorm, defer_batchnorm
from .parallel.cuda_graph import StepGraph, sgd_step
from .parallel.data_parallel import GradientSync, broadcast_modules
from .parallel.pipeline import Chunk, StageRunner, StepResult, sync_device, to_device
from .parallel.segments import compile_part
from .parallel.filter_split import ShardedDropout
from .parallel.plan import Plan, build_part
from .schedule import exchange_plan, forward_only
from .steptime import StepClock

DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}


class Worker:
    """One actor of the mesh. Created by ``cluster.start_workers`` as a Ray actor."""

    def __init__(self, cfg: dict[str, Any], run_name: str, role: str):
        self.cfg = Config(**cfg)
        self.run_name, self.role = run_name, role
        torch.set_num_threads(max(1, self.cfg.num_cpus_per_actor))

    def __repr__(self) -> str:  # the Ray dashboard shows this
        return f"rayconv/{self.run_name}/{self.role}"

    # ------------------------------------------------------------------ bootstrap
    def whereami(self) -> dict[str, Any]:
        """Node id, node IP and GPU ids Ray assigned, for ranking by (node, GPU)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_address(self) -> str:
        """host:port for the process-group rendezvous (called on rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def _pick_device(self) -> torch.device:
        if self.cfg.device != "cuda":
            return torch.device("cpu")
        ids = ray.get_gpu_ids()
        if not ids:
            raise RuntimeError("actor has no GPU assigned by Ray")
        if self.cfg.all_gpus_visible:
            # Actors see every GPU of the node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1): pick ours by index.
            index = visible_index(ids[0])
        else:
            index = 0  # Ray narrowed CUDA_VISIBLE_DEVICES to our GPU
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def setup(self, rank: int, master: str, plan: Plan) -> dict[str, Any]:
        """Join the process groups, build this actor's part of the model and its optimizer.

        Returns parameters held (count) and the device. Raises what data and model loading raise.
        """
        cfg, mesh = self.cfg, plan.mesh
        self.rank, self.plan, self.mesh = rank, plan, mesh
        self.coord = mesh.coord(rank)
        self.device = self._pick_device()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.groups = comm.init_process_groups(mesh, rank, master, backend, cfg.collective_timeout_s)
        self.source = data_mod.make_source(cfg)
        self.sharding = data_mod.Sharding(self.source.train_size, cfg.global_batch_size, mesh.dp, cfg.seed)

        # Every actor builds the same full model from the seed, then keeps its part.
        self.model = run_model(cfg, self.source)
        layers = to_layers(self.model)
        assert tuple(n for n, _ in layers) == plan.layer_names, "plan was made for another model"
        stage, fs_index = self.coord.pp, self.coord.fs
        self.plan_mode = plan.plan == "krizhevsky2014"
        part, in_sizes = build_part(plan, layers, stage, fs_index, self.groups.axis["fs"], self.coord.dp,
                                    self.groups.axis["dp"])
        self.sharded = part
        modules = part.modules
        if cfg.sync_batchnorm:
            # Batch-norm statistics over the global batch (all replicas), on request.
            modules = [nn.SyncBatchNorm.convert_sync_batchnorm(m, process_group=self.groups.axis["dp"])
                       for m in modules]
        elif plan.schedule.num_microbatches > 1:
            # Running statistics advance once per step, from the replica's whole batch (parallel/batchnorm.py).
            modules = [defer_batchnorm(m) for m in modules]
        replicated_at = [any(m is s for s in part.synced) for m in part.modules]
        self.part = nn.Sequential(*modules)
        self.part_names = part.names
        self.deferred_bn = [m for m in self.part.modules() if isinstance(m, DeferredBatchNorm)]
        dtype = DTYPES[cfg.precision]
        self.part.to(device=self.device, dtype=dtype)
        if self.device.type == "cuda":
            self.part.to(memory_format=torch.channels_last)
        self.dtype = dtype
        self.autocast = torch.bfloat16 if cfg.precision == "bf16" else None
        # Images enter the first layer in bf16 under bf16 autocast on GPUs (its convolution would cast them).
        self.input_dtype = torch.bfloat16 if self.autocast is not None and self.device.type == "cuda" else dtype
        wire = torch.bfloat16 if cfg.precision == "bf16" else dtype

        dp_group = self.groups.axis["dp"]
        dp_root = self.groups.ranks["dp"][0]
        # Modules replicated over the dp group start identical; only their gradients are all-reduced.
        self.replicated = [m for m, r in zip(self.part, replicated_at) if r]
        broadcast_modules(self.replicated, dp_root, dp_group)
        self.sync = GradientSync([p for m in self.replicated for p in m.parameters()], dp_group, cfg.bucket_mb,
                                 first_bucket_mb=min(1.0, cfg.bucket_mb))
        self.has_buffers = any(True for m in self.replicated for _ in m.buffers())
        # (one explicit group: a stage of parameter-free layers, e.g. pooling alone, has an empty one)
        self.optimizer = torch.optim.SGD([{"params": list(self.part.parameters())}], lr=cfg.lr,
                                         momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        pp_ranks = self.groups.ranks["pp"]
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        # auto: compile on GPUs (not fp64). Measured (benchmarks/RESULTS.md): 1.44x on ResNet-50, one GPU;
        # with whole-step CUDA graphs also AlexNet's two-GPU layouts (dp=2 1.19x -> 1.38x over one GPU,
        # the per-layer plan 1.37x -> 1.61x). Without graphs, compiled data parallelism had measured slower
        # than eager, so with --cuda-graphs off auto compiles one-GPU runs only.
        graphs_on = self.device.type == "cuda" and cfg.cuda_graphs in ("on", "auto")
        self.compiled = cfg.compile == "on" or (cfg.compile == "auto" and self.device.type == "cuda"
                                                  and cfg.precision != "fp64" and (graphs_on or mesh.world_size == 1))
        # The whole step captured as one CUDA graph and replayed (auto: on every GPU layout), so the CPU
        # launches one graph a step instead of every kernel (parallel/cuda_graph.py).
        self.cuda_graphs = graphs_on
        full_batch = tuple(data_mod.split_sizes(cfg.global_batch_size, mesh.dp))  # per-replica sizes
        self.step_graph = StepGraph(self.device, full_batch) if self.cuda_graphs else None
        # The learning rate on the device, per parameter dtype (float32 below float64: what torch's fused
        # SGD reads), for the captured update; set before each step.
        self.lr_t = {p.dtype: torch.tensor(cfg.lr, device=self.device,
                                           dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
                     for p in self.part.parameters()} if self.cuda_graphs else {}
        # Compiled segments end at the gradient bucket size, so all-reduce overlaps the backward pass.
        limit = self.sync.bucket_bytes if self.sync.group is not None else None
        # The stage's model chunks (one, or V under interleaved 1F1B: virtual stages stage, stage + P, ...),
        # each compiled apart; chunk c's neighbours hold virtual stages v - 1 and v + 1.
        # (One chunk is the whole part, exchange layers of a filter split included.)
        virtual, last_v = plan.virtual_stages(stage), mesh.pp * plan.schedule.num_chunks - 1
        widths = [len(self.part)] if len(virtual) == 1 else [plan.stages[v][1] - plan.stages[v][0] for v in virtual]
        chunks, offset = [], 0
        for v, n in zip(virtual, widths):
            seq = self.part[offset:offset + n]
            offset += n
            chunks.append(Chunk(compile_part(seq, limit) if self.compiled else seq,
                                prev=pp_ranks[(v - 1) % mesh.pp] if v > 0 else None,
                                next=pp_ranks[(v + 1) % mesh.pp] if v < last_v else None,
                                in_shape=_local(plan.stage_in_shape(v), in_sizes, fs_index),
                                out_shape=_local(plan.stage_out_shape(v), part.out_sizes, fs_index)))
        self.runner = StageRunner(chunks, self.groups.axis["pp"], wire_dtype=wire, device=self.device,
                                  autocast=self.autocast)
        self.program = plan.schedule.programs[stage]
        self.exchange_plan = exchange_plan(plan.schedule, stage)
        self.is_first, self.is_last = stage == 0, stage == mesh.pp - 1
        self.first_step = 0
        self.pending: Optional[dict[str, Any]] = None
        self.last_return: Optional[float] = None
        self.last_start: Optional[float] = None
        self.reports = self.is_last and self.coord.fs == 0 and not (self.plan_mode and self.coord.dp != 0)
        return {"rank": rank, "role": self.role, "device": str(self.device), "compiled": self.compiled,
                "cuda_graphs": self.cuda_graphs, "parameters": sum(p.numel() for p in self.part.parameters())}

    # ------------------------------------------------------------------ per step
    def _microbatches(self, split: str, epoch: int, replica_idx: list[np.ndarray], n_mb: int,
                      static: bool = False):
        """Micro-batch sizes and accessors for this actor, from every replica's sample indices.

        Returns (sizes, inputs(m), labels(m), before_forward(m)). Under the per-layer plan the FC
        layers see the whole gathered batch, so labels are those of micro-batch m of every replica.
        With ``static`` (a CUDA graph step) images and labels are copied into the graph's buffers."""
        idx = replica_idx[self.coord.dp]
        slices = data_mod.split_slices(len(idx), n_mb)
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
            per_replica = [data_mod.split_slices(len(r), n_mb) for r in replica_idx]
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
        graphed = graph is not None and graph.will_replay(key)
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

        # With ``profile``, an eager step is synchronised around the all-reduce to time it apart; a step
        # under CUDA graphs is not (nothing may synchronise inside a capture), and counts as compute.
        timed = profile and graph is None
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
        if profile:
            sync_device(self.device)
        t_run = time.perf_counter()
        if graph is not None:
            # Warm-up steps and steps of another shape run eagerly; the rest replay one captured step.
            res = graph.run(key, sgd, generators)
            res.wait_s = None  # (receive and all-reduce waits are not separable inside a captured step)
        else:
            res = sgd()
        allreduce_s = allreduce.get("s")
        self.optimizer.zero_grad(set_to_none=True)
        current = {"rank": self.rank, "step": step, "reports": self.reports, "loss_sum": res.loss_sum,
                   "correct": res.correct, "samples": global_count if self.plan_mode else sum(sizes),
                   "global_count": global_count, "epoch": epoch, "idle_ms": idle_ms,
                   "interval_ms": (t0 - self.last_start) * 1e3 if self.last_start is not None else None}
        self.last_start = t0
        if profile:
            sync_device(self.device)
            total = time.perf_counter() - t_run
            # (inside a CUDA graph step, receive and all-reduce waits are not separable: all compute)
            wait_s, ar_s = res.wait_s or 0.0, allreduce_s or 0.0
            current.update(comm_bytes=self.comm_bytes, step_actor_ms=total * 1e3, wait_ms=None if res.wait_s is None else wait_s * 1e3,
                           allreduce_ms=None if allreduce_s is None else ar_s * 1e3,
                           compute_ms=(total - wait_s - ar_s) * 1e3)
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
        out = _materialise(previous)
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
        out = _materialise(previous)
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

    # ------------------------------------------------------------------ export
    def state(self) -> dict[str, torch.Tensor]:
        """This actor's parameters and buffers on CPU, keyed by the whole model's state_dict names."""
        out = {}
        for name, sub in zip(self.part_names, self.part):
            if name is None:
                continue  # an exchange, no state
            for k, v in sub.state_dict().items():
                out[f"{name}.{k}" if name else k] = v.detach().to("cpu", copy=True)
        return out

    def split_dims(self) -> dict[str, int]:
        """state_dict keys that filter split cuts, and the dimension (empty without filter split)."""
        return dict(self.sharded.split_dims)

    def memory(self) -> dict[str, Any]:
        """Peak device memory in GiB (CUDA only; None on CPU)."""
        if self.device.type != "cuda":
            return {"rank": self.rank, "peak_gib": None}
        return {"rank": self.rank, "peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}

    def shutdown(self) -> None:
        if getattr(self, "sync", None) is not None:
            self.sync.close()
        comm.destroy()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_shard(self) -> bytes:
        """This actor's shard as ``torch.save`` bytes: model state (keys as in ``state()``), optimizer
        state_dict and RNG states, all tensors and plain types (loads with ``weights_only=True``)."""
        np_state = np.random.get_state()
        rng = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
               "numpy_pos": int(np_state[2]), "numpy_has_gauss": int(np_state[3]),
               "numpy_cached_gaussian": float(np_state[4]), "python": _plain(random.getstate())}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        payload = {"rank": self.rank, "role": self.role, "coord": list(self.coord), "model": self.state(),
                   "optimizer": _to_cpu(self.optimizer.state_dict()), "rng": rng}
        buf = io.BytesIO()
        torch.save(payload, buf)
        return buf.getvalue()

    def load_shard(self, blob: bytes, next_step: int) -> None:
        """Load a shard written by ``checkpoint_shard`` (this rank's, or replica 0's after a --dp change);
        the next ``train_step`` is ``next_step``. Raises RuntimeError if it does not fit this part."""
        payload = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        self.load_state(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        rng = payload["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(("MT19937", rng["numpy_keys"].numpy().astype(np.uint32), rng["numpy_pos"],
                             rng["numpy_has_gauss"], rng["numpy_cached_gaussian"]))
        py = rng["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.first_step = next_step
        if self.step_graph is not None:
            self.step_graph.reset()  # the optimizer's momentum buffers are new tensors: capture again

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of ``state()``: copy parameters and buffers into this part (strict: every key of the
        part present, none left over). Raises RuntimeError naming the keys that do not match."""
        used = set()
        for name, sub in zip(self.part_names, self.part):
            if name is None:
                continue
            mine = {}
            for k in sub.state_dict():
                full = f"{name}.{k}" if name else k
                if full in state:
                    mine[k] = state[full]
                    used.add(full)
            sub.load_state_dict(mine, strict=True)
        extra = sorted(set(state) - used)
        if extra:
            raise RuntimeError(f"checkpoint shard holds keys this part does not have: {extra[:5]}")

    # ------------------------------------------------------------------ dashboard metrics
    def _report(self, result: Optional[dict[str, Any]]) -> None:
        """Per-actor gauges in Ray's metrics (dashboard Metrics view): images/s, step ms, loss, peak memory."""
        if not self.cfg.metrics or result is None or not result.get("interval_ms"):
            return
        from .metrics import actor_gauges

        ms = result["interval_ms"]
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        loss = result["loss_sum"] / max(1, result["samples"]) if result["reports"] else None
        actor_gauges(self.run_name, self.role, images_per_s=result["samples"] / max(ms / 1e3, 1e-9),
                     step_ms=ms, loss=loss, peak_memory_gib=peak, step=result["step"])


def visible_index(gpu_id: Any, visible: Optional[str] = None) -> int:
    """torch's device index of the GPU Ray calls ``gpu_id`` when this process sees the node's GPUs:
    Ray's ids are those of the node (its CUDA_VISIBLE_DEVICES, if the node was started with one), so a
    node started with CUDA_VISIBLE_DEVICES=2,3 calls its GPUs 2 and 3, which torch numbers 0 and 1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    listed = [v.strip() for v in visible.split(",")] if visible else []
    return listed.index(str(gpu_id)) if str(gpu_id) in listed else int(gpu_id)


def exception_summary(e: BaseException) -> str:
    """The one-line message of the innermost user-facing error in ``e``."""
    cause: Optional[BaseException] = e
    while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
        cause = cause.cause
    return f"{type(cause).__name__}: {cause}"


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (dicts and lists rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _plain(obj: Any) -> Any:
    """Tuples as lists, recursively (plain types that ``weights_only`` loading accepts)."""
    return [_plain(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


def _local(shape: tuple[int, ...], sizes, index: int) -> tuple[int, ...]:
    """Per-sample shape of this actor's shard of an activation (dim 1 of the batch = dim 0 here)."""
    return shape if sizes is None else (sizes[index], *shape[1:])


def _materialise(m: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Device scalars of a step's metrics to Python numbers (waits for that step only)."""
    if m is None:
        return None
    event, clock = m.pop("event", None), m.pop("clock", None)
    if event is not None:
        event.synchronize()
    return {**m, "loss_sum": float(m["loss_sum"]), "correct": int(m["correct"]), **(clock.read() if clock else {})}

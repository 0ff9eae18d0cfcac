"""Building an actor's part: device choice, process groups, data source, the part of the model
(plan, filter split, sync or deferred batch norm), dtype, optimizer, compile, CUDA graph, the stage
runner and its program. ``BuildMixin.setup`` is the actor's ``setup`` call; ``rayconv/worker.py``'s
``Worker`` inherits it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import ray
import torch
from torch import nn

from rayconv.data.registry import make_source
from rayconv.data.source import Sharding
from rayconv.mesh import split_sizes
from rayconv.models import run_model, to_layers
from rayconv.parallel import comm
from rayconv.parallel.batchnorm import DeferredBatchNorm, defer_batchnorm
from rayconv.actor.cuda_graph import StepGraph
from rayconv.parallel.data_parallel import GradientSync, broadcast_modules
from rayconv.parallel.pipeline.runner import Chunk, StageRunner
from rayconv.parallel.part import compile_part
from rayconv.parallel.layout_plan import LayoutPlan, build_part
from rayconv.parallel.pipeline.validate import exchange_plan

DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}


class BuildMixin:
    """``setup`` and the device choice of ``Worker`` (which holds ``cfg`` and ``role``)."""

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

    def setup(self, rank: int, master: str, plan: LayoutPlan) -> dict[str, Any]:
        """Join the process groups, build this actor's part of the model and its optimizer.

        Returns parameters held (count) and the device. Raises what data and model loading raise.
        """
        cfg, mesh = self.cfg, plan.mesh
        self.rank, self.plan, self.mesh = rank, plan, mesh
        self.coord = mesh.coord(rank)
        self.device = self._pick_device()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.groups = comm.init_process_groups(mesh, rank, master, backend, cfg.collective_timeout_s)
        self.source = make_source(cfg)
        self.sharding = Sharding(self.source.train_size, cfg.global_batch_size, mesh.dp, cfg.seed)

        # Every actor builds the same full model from the seed, then keeps its part.
        self.model = run_model(cfg, self.source)
        layers = to_layers(self.model)
        assert tuple(n for n, _ in layers) == plan.layer_names, "plan was made for another model"
        stage, fs_index = self.coord.pp, self.coord.fs
        self.plan_mode = plan.per_layer_plan == "krizhevsky2014"
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
        # auto: compile on GPUs (not fp64). Without whole-step CUDA graphs, compiled data parallelism runs
        # slower than eager (each segment's launch overhead), so with --cuda-graphs off auto compiles
        # one-GPU runs only.
        graphs_on = self.device.type == "cuda" and cfg.cuda_graphs in ("on", "auto")
        self.compiled = cfg.compile == "on" or (cfg.compile == "auto" and self.device.type == "cuda"
                                                  and cfg.precision != "fp64" and (graphs_on or mesh.world_size == 1))
        # The whole step captured as one CUDA graph and replayed (auto: on every GPU layout), so the CPU
        # launches one graph a step instead of every kernel (parallel/cuda_graph.py).
        self.cuda_graphs = graphs_on
        full_batch = tuple(split_sizes(cfg.global_batch_size, mesh.dp))  # per-replica sizes
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


def visible_index(gpu_id: Any, visible: Optional[str] = None) -> int:
    """torch's device index of the GPU Ray calls ``gpu_id`` when this process sees the node's GPUs:
    Ray's ids are those of the node (its CUDA_VISIBLE_DEVICES, if the node was started with one), so a
    node started with CUDA_VISIBLE_DEVICES=2,3 calls its GPUs 2 and 3, which torch numbers 0 and 1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    listed = [v.strip() for v in visible.split(",")] if visible else []
    return listed.index(str(gpu_id)) if str(gpu_id) in listed else int(gpu_id)


def _local(shape: tuple[int, ...], sizes, index: int) -> tuple[int, ...]:
    """Per-sample shape of this actor's shard of an activation (dim 1 of the batch = dim 0 here)."""
    return shape if sizes is None else (sizes[index], *shape[1:])


"""Building an actor's part: device choice, process groups, data source, the part of the model
(``parallel.parallelize``: cut, filter split or per-layer plan, batch-norm mode, data-parallel sync),
dtype, optimizer and the rest of the recipe (``recipe.py``), compile, CUDA graph, the stage runner and
its program. ``BuildMixin.setup`` is the
actor's ``setup`` call; ``rayconv/actor/worker.py``'s ``Worker`` inherits it and declares the state
it sets.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from rayconv.actor.batches import Batches
from rayconv.actor.cuda_graph import StepGraph
from rayconv.actor.recipe import StepRecipe, build_optimizer
from rayconv.cluster.connect import visible_index
from rayconv.data.order import make_order
from rayconv.data.registry import make_source
from rayconv.data.source import Sharding
from rayconv.errors import ConfigError
from rayconv.mesh import split_sizes
from rayconv.models import run_model, to_layers
from rayconv.parallel import comm
from rayconv.parallel.layout_plan import LayoutPlan
from rayconv.parallel.parallelize import parallelize
from rayconv.parallel.part import compile_part
from rayconv.parallel.pipeline.p2p import exchange_plan
from rayconv.parallel.pipeline.runner import Chunk, StageRunner

DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp16": torch.float32, "fp64": torch.float64}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --precision -> autocast dtype (parameters float32)


class BuildMixin:
    """``setup`` and the device choice of ``Worker`` (which declares the state set here)."""

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
        self.rank, self.plan, self.mesh, self.coord = rank, plan, mesh, mesh.coord(rank)
        self.device = self._pick_device()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.groups = comm.init_process_groups(mesh, rank, master, backend, cfg.collective_timeout_s)
        self.source = make_source(cfg)
        self._set_precision()
        self._build_part()
        self.optimizer = build_optimizer(cfg, self.part)
        self._choose_step_mode()
        stage = self.coord.pp
        self.runner = self._stage_runner()
        self.program = plan.schedule.programs[stage]
        self.exchange_plan = exchange_plan(plan.schedule, stage)
        self.is_first, self.is_last = stage == 0, stage == mesh.pp - 1
        sharding = Sharding(self.source.train_size, cfg.global_batch_size, mesh.dp, cfg.seed,
                            make_order(cfg, self.source))
        self.batches = Batches(self.source, sharding, mesh, self.coord, self.device, self.input_dtype,
                               self.parallel.sharded.batch_gather, mix=(cfg.mixup_alpha, cfg.cutmix_alpha))
        self.recipe = StepRecipe(cfg, self.parallel, self.optimizer, self.groups, self.coord, self.per_layer,
                                 self.device, sharding.steps_per_epoch)
        self.reports = self.is_last and self.coord.fs == 0 and not (self.per_layer and self.coord.dp != 0)
        # Data held on the device (--data-on-device) is decoded here, by the first stage (which reads
        # images), so that the decode is not inside the first timed step.
        hold = getattr(self.source, "hold", None)
        return {"rank": rank, "role": self.role, "device": str(self.device), "compiled": self.compiled,
                "cuda_graphs": self.cuda_graphs, "parameters": sum(p.numel() for p in self.part.parameters()),
                "data_decode": hold(self.device) if hold is not None and self.is_first else None}

    def _set_precision(self) -> None:
        """Parameter dtype, autocast dtype and the images' dtype from ``--precision``: bf16 and fp16
        keep float32 parameters and autocast the forward pass (fp16 with dynamic loss scaling,
        ``recipe.py``; CPU autocast runs float16 convolutions and matrix products too)."""
        self.dtype = DTYPES[self.cfg.precision]
        self.autocast = AUTOCAST.get(self.cfg.precision)
        # Images enter the first layer in the autocast dtype on GPUs (its convolution would cast them).
        cuda_autocast = self.autocast is not None and self.device.type == "cuda"
        self.input_dtype = self.autocast if cuda_autocast else self.dtype

    def _build_part(self) -> None:
        """This actor's part: every actor builds the same full model from the seed, then keeps its part
        (``parallelize``)."""
        layers = to_layers(run_model(self.cfg, self.source, self.dtype))  # (--init loaded in the run's dtype)
        assert tuple(n for n, _ in layers) == self.plan.layer_names, "layout plan was made for another model"
        self.per_layer = self.plan.per_layer_plan == "krizhevsky2014"
        self.parallel = parallelize(self.plan, layers, self.coord, self.groups, self.device, self.dtype,
                                    self.cfg.sync_batchnorm, self.cfg.bucket_mb)
        self.part, self.sync = self.parallel.part, self.parallel.sync

    def _choose_step_mode(self) -> None:
        """Compiled or eager, whole-step CUDA graph or not, and the device learning rates a graph reads."""
        cfg, device = self.cfg, self.device
        if device.type == "cuda":  # (auto resolved by the driver's setup from the run's length)
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark == "on"
        # auto: compile on GPUs (not fp64). Without whole-step CUDA graphs, compiled data parallelism runs
        # slower than eager (each segment's launch overhead), so with --cuda-graphs off auto compiles
        # one-GPU runs only.
        graphs_on = device.type == "cuda" and cfg.cuda_graphs in ("on", "auto") and _graphable(cfg)
        self.compiled = cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda"
                                                  and cfg.precision != "fp64" and (graphs_on or self.mesh.world_size == 1))
        # The whole step captured as one CUDA graph and replayed (auto: on every GPU layout), so the CPU
        # launches one graph a step instead of every kernel (actor/cuda_graph.py).
        self.cuda_graphs = graphs_on
        full_batch = tuple(split_sizes(cfg.global_batch_size, self.mesh.dp))  # per-replica sizes
        self.step_graph = StepGraph(device, full_batch) if self.cuda_graphs else None
        # The learning rate on the device, per parameter dtype (float32 below float64: what torch's fused
        # SGD reads), for the captured update; set before each step.
        self.lr_t = {p.dtype: torch.tensor(cfg.lr, device=device,
                                           dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
                     for p in self.part.parameters()} if self.cuda_graphs else {}

    def _stage_runner(self) -> StageRunner:
        """The stage's model chunks (one, or V under interleaved 1F1B: virtual stages stage, stage + P, ...),
        each compiled apart, and the runner of its program; chunk c's neighbours hold virtual stages
        v - 1 and v + 1. (One chunk is the whole part, exchange layers of a filter split included.)"""
        plan, mesh, stage, fs_index = self.plan, self.mesh, self.coord.pp, self.coord.fs
        pp_ranks = self.groups.ranks["pp"]
        # Compiled segments end at the gradient bucket size, so all-reduce overlaps the backward pass.
        limit = self.sync.bucket_bytes if self.sync.group is not None else None
        virtual, last_v = plan.virtual_stages(stage), mesh.pp * plan.schedule.num_chunks - 1
        widths = [len(self.part)] if len(virtual) == 1 else [plan.stages[v][1] - plan.stages[v][0] for v in virtual]
        chunks, offset = [], 0
        for v, n in zip(virtual, widths):
            seq = self.part[offset:offset + n]
            offset += n
            chunks.append(Chunk(compile_part(seq, limit) if self.compiled else seq,
                                prev=pp_ranks[(v - 1) % mesh.pp] if v > 0 else None,
                                next=pp_ranks[(v + 1) % mesh.pp] if v < last_v else None,
                                in_shape=_local(plan.stage_in_shape(v), self.parallel.in_sizes, fs_index),
                                out_shape=_local(plan.stage_out_shape(v), self.parallel.sharded.out_sizes, fs_index)))
        wire = self.autocast or self.dtype  # activations and their gradients: bf16/fp16 under autocast
        return StageRunner(chunks, self.groups.axis["pp"], wire_dtype=wire, device=self.device,
                           autocast=self.autocast)


def _graphable(cfg) -> bool:
    """Whether this run's step can be captured as a CUDA graph. AdamW and float16 loss scaling run
    eagerly: the captured update is SGD's (``cuda_graph.sgd_step``), and skipping a step on overflow
    is a decision on the host. Raises ConfigError for ``--cuda-graphs on`` with either."""
    eager = [flag for flag, on in (("--opt adamw", cfg.opt == "adamw"), ("--precision fp16", cfg.precision == "fp16"))
             if on]
    if eager and cfg.cuda_graphs == "on":
        raise ConfigError(f"--cuda-graphs on does not combine with {' and '.join(eager)} (those steps run eagerly): "
                          "use --cuda-graphs auto or off")
    return not eager


def _local(shape: tuple[int, ...], sizes, index: int) -> tuple[int, ...]:
    """Per-sample shape of this actor's shard of an activation (dim 1 of the batch = dim 0 here)."""
    return shape if sizes is None else (sizes[index], *shape[1:])


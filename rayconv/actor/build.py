"""An actor's state, built once by its ``build`` call (``build_actor``): device choice, process groups,
data source and batches, the part of the model (``parallel.parallelize``: cut, filter split or per-layer
plan, batch-norm mode, data-parallel sync), dtype, optimizer and the rest of the recipe (``recipe_step.py``),
compile, CUDA graph, the stage runner and its program. ``ActorState`` is that one object; the step
(``step.py``), the state calls (``state.py``) and the metrics (``report.py``) read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from rayconv.actor.batches import Batches
from rayconv.actor.cuda_graph import StepGraph
from rayconv.actor.recipe_step import RecipeStep, build_optimizer, run_epochs
from rayconv.cluster.connect import assigned_gpu_index
from rayconv.config import Config
from rayconv.data.registry import make_source
from rayconv.data.source import Sharding, Source
from rayconv.errors import ConfigError
from rayconv.mesh import Coord, Mesh, split_sizes
from rayconv.models import run_model, to_layers
from rayconv.outputs.export import state_keys
from rayconv.parallel import comm
from rayconv.parallel.data_parallel import GradientSync
from rayconv.parallel.filter_split.layers import SlicedDropout
from rayconv.parallel.routing import Routing
from rayconv.parallel.parallelize import ParallelPart, parallelize
from rayconv.parallel.segments import compile_part
from rayconv.parallel.pipeline.p2p import Post, p2p_posts
from rayconv.parallel.pipeline.runner import Chunk, StageRunner
from rayconv.parallel.pipeline.schedules import Action
from rayconv.settings import ClusterSettings, ExecutionSettings

DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp16": torch.float32, "fp64": torch.float64}
# --precision -> autocast dtype (parameters float32)
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ActorState:
    """Everything one actor holds, set once by ``build_actor`` except the per-step fields at the end.

    * ``cfg``, ``run_name``, ``role``; ``rank``, ``routing`` (the ``Routing``), ``mesh``, ``coord``
      (this actor's (dp, pp, fs)), ``device``, ``groups`` (its process groups);
    * ``source`` (the data), ``batches`` (which micro-batches it reads, ``batches.py``);
    * ``parallel`` (``parallelize``'s result: the part, its layer names, split, replicated modules,
      gradient sync, deferred batch norms), ``part`` and ``sync`` (``parallel.part``, ``parallel.sync``),
      ``per_layer`` (under Krizhevsky 2014's per-layer plan);
    * ``dtype`` (parameters), ``autocast`` (bf16, fp16 or None), ``input_dtype`` (images), ``optimizer``
      (``--opt`` over ``recipe.optim``'s groups), ``recipe`` (``recipe_step.RecipeStep``: loss scale,
      clipping, moving average);
    * ``compiled``, ``cuda_graphs``, ``step_graph`` (the captured step or None), ``lr_t`` (device
      learning rates for a captured update, by parameter dtype);
    * ``runner`` (the stage's ``StageRunner``), ``program`` and ``p2p_posts`` (its actions and
      their sends and receives), ``reports`` (whether this actor's loss is the one the driver reads),
      ``sliced_dropouts`` (filter split's dropouts, ``step.seed`` reseeds them);
    * per step (``step.py``): ``pending`` (the metrics of the step in flight), ``last_start``,
      ``last_return`` (perf_counter seconds of the last call's start and return), ``comm_bytes``
      (bytes handed to torch.distributed by the last eager step), ``gauges_at``, ``train_mode``.
    """

    cfg: Config
    run_name: str
    role: str
    rank: int
    routing: Routing
    mesh: Mesh
    coord: Coord
    device: torch.device
    groups: comm.Groups
    source: Source
    batches: Batches
    parallel: ParallelPart
    part: nn.Sequential
    sync: GradientSync
    per_layer: bool
    dtype: torch.dtype
    autocast: Optional[torch.dtype]
    input_dtype: torch.dtype
    optimizer: torch.optim.Optimizer
    recipe: RecipeStep
    compiled: bool
    cuda_graphs: bool
    step_graph: Optional[StepGraph]
    lr_t: dict[torch.dtype, torch.Tensor]
    runner: StageRunner
    program: tuple[Action, ...]
    p2p_posts: list[tuple[Post, ...]]
    reports: bool
    sliced_dropouts: list[tuple[str, SlicedDropout]]  # the part's split dropouts by name (reseeded each step)
    pending: Optional[dict[str, Any]] = None
    last_start: Optional[float] = None
    last_return: Optional[float] = None
    comm_bytes: int = 0
    # perf_counter seconds when the gauges were last set (``report.report_gauges``)
    gauges_at: Optional[float] = None
    # the part was last put in training mode (``part.train()``) by a step, not an evaluation
    train_mode: bool = False
    full_batch: tuple[int, ...] = ()  # per-replica sizes of a full global batch (a captured step's key)
    shapes_fixed: bool = False  # compiled segments compile no new shape (``segments.fix_shapes``)
    data_decode: Optional[dict[str, Any]] = None  # the one-time decode of data held on the device
    # the whole model's state_dict keys and shapes as built (``outputs.export.state_keys``): the export's
    # check
    model_keys: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    # seconds from the build's start to its model built (on the device), its optimizer built and its data
    # on the device, and the whole build's (``setup``, set by the caller): the run's start-up record
    # (``rayconv.startup``)
    startup: dict[str, float] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        """What ``build`` returns: rank, role, device, compiled, CUDA graphs, parameters held (count),
        the one-time decode of data held on the device (seconds, images, workers; None: none held), the
        build's start-up splits (seconds)."""
        return {"rank": self.rank, "role": self.role, "device": str(self.device), "compiled": self.compiled,
                "cuda_graphs": self.cuda_graphs, "parameters": sum(p.numel() for p in self.part.parameters()),
                "data_decode": self.data_decode, "startup": dict(self.startup)}


def build_actor(cfg: Config, run_name: str, role: str, rank: int, master: str, routing: Routing,
                sharding: Sharding) -> ActorState:
    """Join the process groups, build this actor's part of the model, its optimizer and the rest of
    its state, in that order. ``sharding``: the train sharding the driver made (``driver.resolve``).
    Raises what data and model loading raise."""
    t0 = time.perf_counter()
    mesh = routing.mesh
    coord = mesh.coord(rank)
    device = pick_device(cfg)
    backend = "nccl" if device.type == "cuda" else "gloo"
    groups = comm.init_process_groups(mesh, rank, master, backend, cfg.collective_timeout_s)
    source = make_source(cfg)
    dtype, autocast, input_dtype = _precision(cfg, device)
    # This actor's part: every actor builds the same full model from the seed, then keeps its part.
    model = run_model(cfg, source, dtype)  # (--init loaded in the run's dtype)
    model_keys = state_keys(model)
    layers = to_layers(model)
    assert tuple(n for n, _ in layers) == routing.layer_names, "routing was made for another model"
    per_layer = routing.per_layer_plan == "krizhevsky2014"
    parallel = parallelize(routing, layers, coord, groups, device, dtype, cfg.sync_batchnorm, cfg.bucket_mb)
    part, sync = parallel.part, parallel.sync
    built_s = time.perf_counter() - t0
    optimizer = build_optimizer(cfg, part)
    optimizer_s = time.perf_counter() - t0
    compiled, cuda_graphs, step_graph, lr_t = _step_mode(cfg, device, mesh, part)
    stage = coord.pp
    runner = _stage_runner(routing=routing, mesh=mesh, coord=coord, groups=groups, part=part, sync=sync,
                           parallel=parallel, compiled=compiled, device=device, dtype=dtype,
                           autocast=autocast)
    is_last = stage == mesh.pp - 1
    batches = Batches(source, sharding, mesh, coord, device, input_dtype, parallel.sliced.batch_gather,
                      mix=(cfg.mixup_alpha, cfg.cutmix_alpha),
                      epochs=run_epochs(cfg, sharding.steps_per_epoch))
    recipe = RecipeStep(cfg, parallel, optimizer, groups, coord, per_layer, device, sharding.steps_per_epoch)
    # Data held on the device (--data-on-device) is decoded here, by the first stage (which reads
    # images), so that the decode is not inside the first timed step.
    hold = getattr(source, "hold", None)
    data_decode = hold(device) if hold is not None and stage == 0 else None
    if hold is None and stage == 0 and hasattr(source, "load"):
        source.load(device)  # (the images held on the device: copied now, not in the first step)
    data_s = time.perf_counter() - t0
    return ActorState(
        cfg=cfg, run_name=run_name, role=role, rank=rank, routing=routing, mesh=mesh, coord=coord,
        device=device, groups=groups, source=source, batches=batches, parallel=parallel, part=part, sync=sync,
        per_layer=per_layer, dtype=dtype, autocast=autocast, input_dtype=input_dtype, optimizer=optimizer,
        recipe=recipe, compiled=compiled, cuda_graphs=cuda_graphs, step_graph=step_graph, lr_t=lr_t,
        runner=runner, program=routing.schedule.programs[stage], p2p_posts=p2p_posts(routing.schedule, stage),
        reports=is_last and coord.fs == 0 and not (per_layer and coord.dp != 0), data_decode=data_decode,
        sliced_dropouts=[(n, m) for n, m in part.named_modules() if isinstance(m, SlicedDropout)],
        full_batch=tuple(split_sizes(cfg.global_batch_size, mesh.dp)), model_keys=model_keys,
        startup={"model_built": built_s, "optimizer_built": optimizer_s, "data_on_device": data_s})


def pick_device(cfg: ClusterSettings) -> torch.device:
    if cfg.device != "cuda":
        return torch.device("cpu")
    index = assigned_gpu_index()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _precision(cfg: ExecutionSettings,
               device: torch.device) -> tuple[torch.dtype, Optional[torch.dtype], torch.dtype]:
    """(parameter dtype, autocast dtype, the images' dtype) from ``--precision``: bf16 and fp16 keep
    float32 parameters and autocast the forward pass (fp16 with dynamic loss scaling, ``recipe.py``;
    CPU autocast runs float16 convolutions and matrix products too)."""
    dtype = DTYPES[cfg.precision]
    autocast = AUTOCAST.get(cfg.precision)
    # Images enter the first layer in the autocast dtype on GPUs (its convolution would cast them).
    cuda_autocast = autocast is not None and device.type == "cuda"
    return dtype, autocast, autocast if cuda_autocast else dtype


def set_up_cuda_libraries(device: torch.device, precision: Optional[str]) -> bool:
    """cuDNN's and cuBLAS's one-time set-up in this process (their libraries loaded, their handles made),
    by a tiny convolution, batch norm and linear layer, forward and backward, on ``device`` in
    ``--precision``'s autocast dtype (``AUTOCAST``): an actor's warm-up runs it before ``build``, so that
    the first training step does not pay it. Draws no random numbers (the model is built from the seed
    later) and keeps nothing: the handles go back to torch's pool, for the thread that steps. Returns
    whether it ran; a failure is left for ``build``."""
    F = torch.nn.functional
    try:
        dtype = AUTOCAST.get(precision or "")
        x = torch.zeros(2, 8, 8, 8, device=device, requires_grad=True).contiguous(
            memory_format=torch.channels_last
        )
        w = torch.zeros(8, 8, 3, 3, device=device, requires_grad=True)
        scale, shift = (torch.ones(8, device=device, requires_grad=True),
                        torch.zeros(8, device=device, requires_grad=True))
        fc = torch.zeros(4, 8 * 6 * 6, device=device, requires_grad=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            y = F.batch_norm(F.conv2d(x, w), None, None, scale, shift, training=True).relu()
            F.linear(y.flatten(1), fc).sum().backward()
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - build reports it
        return False


def _step_mode(cfg: Config, device: torch.device, mesh: Mesh, part: nn.Module
               ) -> tuple[bool, bool, Optional[StepGraph], dict[torch.dtype, torch.Tensor]]:
    """(compiled, whole-step CUDA graphs, the ``StepGraph`` or None, the device learning rates a
    graph reads)."""
    if device.type == "cuda":  # (auto resolved by the driver's setup from the run's length)
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark == "on"
    # auto: compile on GPUs (not fp64). Without whole-step CUDA graphs, compiled data parallelism runs
    # slower than eager (each segment's launch overhead), so with --cuda-graphs off auto compiles
    # one-GPU runs only.
    graphs_on = device.type == "cuda" and cfg.cuda_graphs in ("on", "auto") and _graphable(cfg)
    compiled = cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda"
                                       and cfg.precision != "fp64" and (graphs_on or mesh.world_size == 1))
    # The whole step captured as one CUDA graph and replayed (auto: on every GPU layout), so the CPU
    # launches one graph a step instead of every kernel (actor/cuda_graph.py).
    cuda_graphs = graphs_on
    full_batch = tuple(split_sizes(cfg.global_batch_size, mesh.dp))  # per-replica sizes
    step_graph = StepGraph(device, full_batch) if cuda_graphs else None
    # The learning rate on the device, per parameter dtype (float32 below float64: what torch's fused
    # SGD reads), for the captured update; set before each step.
    lr_t = {p.dtype: torch.tensor(cfg.lr, device=device,
                                  dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
            for p in part.parameters()} if cuda_graphs else {}
    return compiled, cuda_graphs, step_graph, lr_t


def _stage_runner(*, routing: Routing, mesh: Mesh, coord: Coord, groups: comm.Groups, part: nn.Sequential,
                  sync: GradientSync, parallel: ParallelPart, compiled: bool, device: torch.device,
                  dtype: torch.dtype, autocast: Optional[torch.dtype]) -> StageRunner:
    """The stage's model chunks (one, or V under interleaved 1F1B: virtual stages stage, stage + P, ...),
    each compiled apart, and the runner of its program; chunk c's neighbours hold virtual stages
    v - 1 and v + 1. (One chunk is the whole part, exchange layers of a filter split included.)"""
    stage, fs_index = coord.pp, coord.fs
    pp_ranks = groups.ranks["pp"]
    # Compiled segments end at the gradient bucket size, so all-reduce overlaps the backward pass.
    limit = sync.bucket_bytes if sync.group is not None else None
    virtual, last_v = routing.virtual_stages(stage), mesh.pp * routing.schedule.virtual_stages - 1
    widths = [len(part)] if len(virtual) == 1 else [routing.stages[v][1] - routing.stages[v][0]
                                                    for v in virtual]
    chunks, offset = [], 0
    for v, n in zip(virtual, widths):
        seq = part[offset:offset + n]
        offset += n
        chunks.append(
            Chunk(
                compile_part(seq, limit) if compiled else seq,
                prev=pp_ranks[(v - 1) % mesh.pp] if v > 0 else None,
                next=pp_ranks[(v + 1) % mesh.pp] if v < last_v else None,
                in_shape=_local(routing.stage_in_shape(v), parallel.in_sizes, fs_index),
                out_shape=_local(routing.stage_out_shape(v), parallel.sliced.out_sizes, fs_index),
            )
        )
    wire = autocast or dtype  # activations and their gradients: bf16/fp16 under autocast
    return StageRunner(chunks, groups.axis["pp"], wire_dtype=wire, device=device, autocast=autocast)


def _graphable(cfg) -> bool:
    """Whether this run's step can be captured as a CUDA graph. AdamW and float16 loss scaling run
    eagerly: the captured update is SGD's (``cuda_graph.sgd_step``), and skipping a step on overflow
    is a decision on the host. Raises ConfigError for ``--cuda-graphs on`` with either."""
    eager = [flag for flag, on in (("--opt adamw", cfg.opt == "adamw"),
                                   ("--precision fp16", cfg.precision == "fp16")) if on]
    if eager and cfg.cuda_graphs == "on":
        raise ConfigError(f"--cuda-graphs on does not combine with {' and '.join(eager)} (those steps run "
                          "eagerly): use --cuda-graphs auto or off")
    return not eager


def _local(shape: tuple[int, ...], sizes, index: int) -> tuple[int, ...]:
    """Per-sample shape of this actor's slice of an activation (dim 1 of the batch = dim 0 here)."""
    return shape if sizes is None else (sizes[index], *shape[1:])


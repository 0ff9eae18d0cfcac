"""The Ray actor: one per device, holding one part of the model (a replica, a stage, a filter shard).

The driver has the actor group (``rayconv/cluster/group.py``) create the actors, send each its rank
and the layout plan once (``setup``), then make one ``train_step`` call per actor per step. Inside the
step, the actor reads its own data shard, runs its stage program, exchanges activations and gradients
with its neighbours and all-reduces gradients with its data-parallel group, all through
torch.distributed (``parallel/comm.py``): no tensor of the training path passes through the driver
or the Ray object store.

``Worker`` holds the actor's state (declared in ``__init__``), the bootstrap calls (``whereami``,
``free_address``, ``shutdown``) and inherits the rest, one concept a file under ``rayconv/actor/``:

    build.py    ``setup``: device, process groups, the part of the model, optimizer, compile, CUDA graph
    recipe.py   the optimizer's groups, fp16 loss scaling, gradient clipping, the moving average
    step.py     ``train_step``, ``train_steps``, ``trace``, ``flush``, ``evaluate``: the step program;
                ``inject_overflow`` and ``loss_scale_state`` (the fp16 test hook and its read-out)
    batches.py  which micro-batches this actor reads, and what it announces to the loader
    loss.py     the loss of the last stage, micro-batch by micro-batch
    state.py    ``state``, ``load_state``, ``split_dims``, ``checkpoint_shard``, ``load_shard`` (``state``
                and ``evaluate`` take ``ema=True`` for the moving average's weights)
    report.py   ``memory`` and the per-actor gauges in Ray's metrics
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

import ray
import torch
from torch import nn

from rayconv.actor.batches import Batches
from rayconv.actor.build import BuildMixin
from rayconv.actor.cuda_graph import StepGraph
from rayconv.actor.recipe import StepRecipe
from rayconv.actor.report import ReportMixin
from rayconv.actor.rss import RssSampler
from rayconv.actor.state import StateMixin
from rayconv.actor.step import StepMixin
from rayconv.actor.steptime import StepClock
from rayconv.config import Config
from rayconv.data.source import Source
from rayconv.errors import DataError
from rayconv.mesh import Coord, Mesh
from rayconv.parallel import comm
from rayconv.parallel.data_parallel import GradientSync
from rayconv.parallel.layout_plan import LayoutPlan
from rayconv.parallel.parallelize import ParallelPart
from rayconv.parallel.pipeline.p2p import Post
from rayconv.parallel.pipeline.runner import StageRunner
from rayconv.parallel.pipeline.schedules import Action

__all__ = ["Worker"]


class Worker(BuildMixin, StepMixin, StateMixin, ReportMixin):
    """One actor of the mesh, created as a Ray actor by the actor group (``rayconv/cluster/group.py``).

    Its state, which the mixins share (all set by ``setup`` unless noted):

    * ``cfg``, ``run_name``, ``role`` (constructor); ``rank``, ``plan`` (the ``LayoutPlan``),
      ``mesh``, ``coord`` (this actor's (dp, pp, fs)), ``device``, ``groups`` (its process groups);
    * ``source`` (the data), ``batches`` (which micro-batches it reads, ``batches.py``);
    * ``parallel`` (``parallelize``'s result: the part, its layer names, split, replicated modules,
      gradient sync, deferred batch norms), ``part`` and ``sync`` (``parallel.part``, ``parallel.sync``),
      ``per_layer`` (under Krizhevsky 2014's per-layer plan);
    * ``dtype`` (parameters), ``autocast`` (bf16, fp16 or None), ``input_dtype`` (images), ``optimizer``
      (``--opt`` over ``recipe.optim``'s groups), ``recipe`` (``recipe.StepRecipe``: loss scale,
      clipping, moving average);
    * ``compiled``, ``cuda_graphs``, ``step_graph`` (the captured step or None), ``lr_t`` (device
      learning rates for a captured update, by parameter dtype);
    * ``runner`` (the stage's ``StageRunner``), ``program`` and ``exchange_plan`` (its actions and
      their sends and receives), ``is_first``, ``is_last`` (pipeline ends), ``reports`` (whether this
      actor's loss is the one the driver reads);
    * per step (``step.py``): ``pending`` (the metrics of the step in flight), ``last_start``,
      ``last_return`` (perf_counter seconds of the last call's start and return), ``clock`` (the step's
      ``StepClock``), ``comm_bytes`` (bytes handed to torch.distributed by the last eager step).
    """

    def __init__(self, cfg: dict[str, Any], run_name: str, role: str):
        self.cfg = Config(**cfg)
        self.run_name, self.role = run_name, role
        torch.set_num_threads(max(1, self.cfg.num_cpus_per_actor))
        # where it is (setup)
        self.rank: int = -1
        self.plan: Optional[LayoutPlan] = None
        self.mesh: Optional[Mesh] = None
        self.coord: Optional[Coord] = None
        self.device: torch.device = torch.device("cpu")
        self.groups: Optional[comm.Groups] = None
        # what it reads and runs (setup)
        self.source: Optional[Source] = None
        self.batches: Optional[Batches] = None
        self.parallel: Optional[ParallelPart] = None
        self.part: nn.Sequential = nn.Sequential()
        self.sync: Optional[GradientSync] = None
        self.per_layer: bool = False
        self.dtype: torch.dtype = torch.float32
        self.autocast: Optional[torch.dtype] = None
        self.input_dtype: torch.dtype = torch.float32
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.recipe: Optional[StepRecipe] = None
        # how a step runs (setup)
        self.compiled: bool = False
        self.cuda_graphs: bool = False
        self.step_graph: Optional[StepGraph] = None
        self.lr_t: dict[torch.dtype, torch.Tensor] = {}
        self.runner: Optional[StageRunner] = None
        self.program: tuple[Action, ...] = ()
        self.exchange_plan: list[tuple[Post, ...]] = []
        self.is_first: bool = False
        self.is_last: bool = False
        self.reports: bool = False
        # per step (step.py)
        self.pending: Optional[dict[str, Any]] = None
        self.last_start: Optional[float] = None
        self.last_return: Optional[float] = None
        self.clock: Optional[StepClock] = None
        self.comm_bytes: int = 0
        self.rss = RssSampler(os.getpid())   # peak RssAnon of this actor and its loader processes

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

    def train_step(self, step: int, lr: float, profile: bool = False) -> Optional[dict[str, Any]]:
        """``StepMixin.train_step``; a DataError (e.g. a shard that disappeared or changed during the run)
        is re-raised naming the step, so that the driver's one line says which step stopped."""
        try:
            return StepMixin.train_step(self, step, lr, profile)
        except DataError as e:
            raise DataError(f"step {step}: {e}") from None

    def memory(self) -> dict[str, Any]:
        """``ReportMixin.memory`` plus the peak RssAnon (MiB) of this actor and of its loader processes."""
        return {**ReportMixin.memory(self), **self.rss.peaks()}

    def shutdown(self) -> None:
        """Remove the gradient hooks and leave the process groups (the last call to an actor)."""
        if self.sync is not None:
            self.sync.close()
        comm.destroy()

"""The Ray actor: one per device, holding one part of the model (a replica, a stage, a filter shard).

The driver creates the actors (``cluster.py``), sends each its rank and the plan once (``setup``),
then makes one ``train_step`` call per actor per step. Inside the step, the actor reads its own data
shard, runs its stage program, exchanges activations and gradients with its neighbours and all-reduces
gradients with its data-parallel group, all through torch.distributed (``parallel/comm.py``): no
tensor of the training path passes through the driver or the Ray object store.

``Worker`` holds the bootstrap calls (``whereami``, ``free_address``, ``shutdown``) and inherits the
rest, one concept a file under ``rayconv/actor/``:

    build.py    ``setup``: device, process groups, the part of the model, optimizer, compile, CUDA graph
    step.py     ``train_step``, ``train_steps``, ``trace``, ``flush``, ``evaluate``: the step program
    state.py    ``state``, ``load_state``, ``split_dims``, ``checkpoint_shard``, ``load_shard``
    report.py   ``memory`` and the per-actor gauges in Ray's metrics
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

import ray
import torch

from rayconv.actor.build import BuildMixin, visible_index
from rayconv.actor.report import ReportMixin
from rayconv.actor.state import StateMixin
from rayconv.actor.step import StepMixin
from rayconv.config import Config
from rayconv.parallel import comm

__all__ = ["Worker", "exception_summary", "visible_index"]


class Worker(BuildMixin, StepMixin, StateMixin, ReportMixin):
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

    def shutdown(self) -> None:
        """Remove the gradient hooks and leave the process groups (the last call to an actor)."""
        if getattr(self, "sync", None) is not None:
            self.sync.close()
        comm.destroy()


def exception_summary(e: BaseException) -> str:
    """The one-line message of the innermost user-facing error in ``e``."""
    cause: Optional[BaseException] = e
    while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
        cause = cause.cause
    return f"{type(cause).__name__}: {cause}"


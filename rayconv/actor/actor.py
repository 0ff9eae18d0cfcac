"""The Ray actor: one per device, holding one part of the model (a replica, a stage, a filter-split slice).

The driver has the actor group (``rayconv/cluster/group.py``) create the actors, send each its rank,
the routing and the train sharding once (``build``), then make one ``train_step`` call per actor
per step. Inside the step, the actor reads its own replica batch, runs its stage program, exchanges
activations and gradients with its neighbours and all-reduces gradients with its data-parallel group,
all through torch.distributed (``parallel/comm.py``): no tensor of the training path passes through
the driver or the Ray object store.

``Actor`` is the actor's training entries (and two test hooks at its end); each reads or changes the
one ``ActorState`` that ``build`` builds. The rest, one concept a file under ``rayconv/actor/``:

    lifecycle.py  ``ActorLifecycle``, the class ``Actor`` extends: the process started and warmed up,
                renewed or resting between runs, kept for the next command, SIGTERM, its end
    build.py    ``ActorState`` and ``build_actor``: device, process groups, the part of the model,
                optimizer, compile, CUDA graph, the stage runner and its program
    step.py     ``train_step`` (the step in the order it runs), ``forward_backward_update`` (its captured
                part), ``flush``, ``evaluate``
    recipe_step.py   the optimizer's groups, fp16 loss scaling, gradient clipping, the moving average
    batches.py  which micro-batches this actor reads, and what it announces to the loader
    loss.py     the loss of the last stage, micro-batch by micro-batch
    state.py    parameters and rank files in and out; the moving average's weights swapped in
    precise_bn.py  batch-norm running statistics recomputed over training batches before an evaluation
    report.py   metrics: ``materialise``, the per-actor gauges in Ray's metrics, ``memory``, ``trace``
    cuda_graph.py  the whole step as one CUDA graph (``StepGraph``) and its SGD update
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import ray

from rayconv.actor.lifecycle import ActorLifecycle
from rayconv.config import Config
from rayconv.errors import DataError
from rayconv.mesh import Mesh

if TYPE_CHECKING:
    import torch

    from rayconv.data.source import Sharding
    from rayconv.parallel.routing import Routing

__all__ = ["Actor"]


class Actor(ActorLifecycle):
    """One actor of the mesh, created as a Ray actor by the actor group (``rayconv/cluster/group.py``):
    the training entries, one call each from the driver; its process's life is ``ActorLifecycle``'s.
    ``a`` is its ``build.ActorState`` (None until ``build``)."""

    # ------------------------------------------------------------------ bootstrap
    def open_rendezvous(self) -> str:
        """host:port of the process-group rendezvous this actor (rank 0) opens (``comm.open_rendezvous``)."""
        return self.code.comm.open_rendezvous(ray.util.get_node_ip_address(), self.cfg.collective_timeout_s)

    def can_write(self, uri: str) -> Optional[str]:
        """Whether this actor's node can write into the store's folder ``uri`` (where the run's
        checkpoints go): None, or why not in one line (``storage_checks.node_can_write``)."""
        from rayconv.storage_checks import node_can_write

        return node_can_write(uri)

    def check_model(self, cfg: dict[str, Any], mesh: tuple[int, int, int], num_classes: int,
                    sample_shape: tuple[int, ...], data_channels: int, check: bool = True) -> Routing:
        """``routing.checked_routing`` of run ``cfg``'s model for ``mesh`` (dp, pp, fs), made here for a
        driver that has not imported torchvision (``driver.resolve.WarmCheck``: this actor has, in its
        warm-up). Raises ConfigError / LayoutError as the driver's own check would."""
        self._imported.wait()   # (the warm-up sets up the CUDA libraries meanwhile, without the interpreter)
        from rayconv.parallel.routing import checked_routing

        return checked_routing(Config(**cfg), Mesh(*mesh), num_classes, tuple(sample_shape), data_channels,
                               check=check)[1]

    def build(self, rank: int, master: str, routing: Routing, sharding: Sharding,
              cfg: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Join the process groups, build this actor's part of the model, its optimizer and the rest of
        its state (``build.build_actor``), under ``cfg`` (the run's settings as resolved once the driver's
        checks ended, ``Config.to_dict``; None: those the actor was created with). Returns parameters
        held (count) and the device. Raises what data and model loading raise."""
        t0 = time.perf_counter()
        self.stamps["build"] = time.time()
        self._warm.join()
        waited = time.perf_counter() - t0
        if cfg is not None:
            self.cfg = Config(**cfg)
        self.a = self.code.build_actor(self.cfg, self.run_name, self.role, rank, master, routing, sharding)
        # (the run's start-up record: the splits from this call's start, the wait for the warm-up included)
        self.a.startup = {k: v + waited for k, v in self.a.startup.items()}
        self.a.startup.update(warmed_up=waited, setup=time.perf_counter() - t0)
        self.stamps["built"] = time.time()
        return {**self.a.report(), "stamps": dict(self.stamps)}

    # ------------------------------------------------------------------ steps
    def train_step(self, step: int, lr: float, profile: bool = False) -> Optional[dict[str, Any]]:
        """One training step (``step.train_step``: what it returns and raises); a DataError (e.g. a
        shard that disappeared or changed during the run) is re-raised naming the step, so that the
        driver's one line says which step stopped."""
        t0 = time.perf_counter()
        try:
            out = self.code.step.train_step(self.a, step, lr, profile, t0)
        except DataError as e:
            raise DataError(f"step {step}: {e}") from None
        # (after the step's locals, its autograd graph among them, are freed: that is the actor's
        # time, not time spent waiting for the driver's next call)
        self.a.last_return = time.perf_counter()
        return self._marked(out)

    def _marked(self, out: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        """A step's metrics with ``preempted`` (this actor's role) once it took SIGTERM (``_take_sigterm``),
        and ``saved``, the results of its checkpoint parts written since the last handed over (a list,
        oldest first: ``saver.Saver.finished``, the driver's poll)."""
        if out is not None and self.preempted:
            out["preempted"] = self.role
        if out is not None:
            saved = self.saver.finished()
            if saved:
                out["saved"] = saved
        return out

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
        return self._marked(self.code.step.flush(self.a))

    def trace(self, first_step: int, steps: int, lr: float) -> dict[str, Any]:
        """``steps`` steps under torch.profiler, then as many under cProfile (``report.trace``)."""
        return self.code.report.trace(self.a, self.train_steps, self.flush, first_step, steps, lr)

    def evaluate(self, ema: bool = False, split: str = "test") -> dict[str, Any]:
        """Loss sum (unsmoothed cross entropy) and correct counts over this replica's share of the
        held-out set (each sample once; ``split`` "val": --val-split's images); ``ema``: of the moving
        average's weights (--model-ema; the model's own are restored after, ``state.weights``). Raises
        RuntimeError for ``ema`` without --model-ema."""
        with self.code.state.weights(self.a, ema):
            return self.code.step.evaluate(self.a, split)

    def recalibrate_bn(self, next_step: int, ema: bool = False) -> int:
        """``precise_bn.recalibrate``: the batch-norm running statistics recomputed over the
        --precise-bn-batches training batches from global step ``next_step`` on (``ema``: the moving
        average's too). Returns the batches averaged."""
        return self.code.precise_bn.recalibrate(self.a, next_step, ema)

    # ------------------------------------------------------------------ state (state.py)
    def model_state(self, ema: bool = False) -> dict[str, torch.Tensor]:
        """``state.model_state``: this actor's parameters and buffers on CPU (``ema``: the moving
        average's)."""
        return self.code.state.model_state(self.a, ema)

    def load_model_state(self, values: dict[str, torch.Tensor]) -> None:
        """``state.load_model_state``: the inverse of ``model_state()``."""
        self.code.state.load_model_state(self.a, values)

    def model_keys(self) -> list[tuple[str, tuple[int, ...]]]:
        """The whole model's state_dict keys and shapes as this actor built it (``export.state_keys``)."""
        return self.a.model_keys

    def split_dims(self) -> dict[str, int]:
        """``state.split_dims``: state_dict keys that filter split cuts, and the dimension."""
        return self.code.state.split_dims(self.a)

    def rank_file(self) -> bytes:
        """``state.rank_file``: this actor's rank file as ``torch.save`` bytes."""
        return self.code.state.rank_file(self.a)

    def checkpoint_start(self, step: int, where: Any) -> None:
        """Copy this actor's part of the checkpoint of ``step`` steps to host memory
        (``state.checkpoint_rank_file``) and return; a background thread writes it to ``where`` (the
        checkpoint's folder: a ``storage.Location`` or a ``cluster.sink.SinkFolder``) as
        ``rank-<rank>.pt``. Waits first for this actor's previous write, if any, whose result is kept
        for the driver (``saver.Saver``): the driver may begin a checkpoint before it has the one before."""
        self.saver.join()   # (one host copy at a time)
        header, tensors, copied = self.code.state.checkpoint_rank_file(self.a)
        self.saver.start(step, where / f"rank-{self.a.rank}.pt", header, tensors, copied)

    def checkpoint_wait(self) -> list[dict[str, Any]]:
        """The results of the checkpoint parts written and not handed over yet (``saver.Saver``: step and
        files, or step and error; oldest first), once the last is written; [] when there are none."""
        return self.saver.wait()

    def load_rank_file(self, blob: bytes, next_step: int) -> None:
        """``state.load_rank_file``: load a rank file written by ``rank_file``; ``next_step`` comes next."""
        self.code.state.load_rank_file(self.a, blob, next_step)

    # ------------------------------------------------------------------ metrics, end
    def memory(self) -> dict[str, Any]:
        """Peak device memory in GiB (``report.memory``) plus the peak RssAnon (MiB) of this actor and
        of its loader processes."""
        return {**self.code.report.memory(self.a), **self.rss.peaks()}

    # ------------------------------------------------------------------ test hooks
    def inject_overflow(self, step: int) -> None:
        """Test hook: at ``step`` (under --precision fp16), make this actor's first gradient inf after
        the backward pass, as an overflow would (``recipe_step.RecipeStep.before_update``)."""
        self.a.recipe.overflow_at = step

    def loss_scale_state(self) -> Optional[dict[str, Any]]:
        """The float16 loss scale's state (``DynamicLossScale.state_dict``) and whether the last step
        was skipped; None without --precision fp16."""
        scaler = self.a.recipe.scaler
        return None if scaler is None else {**scaler.state_dict(), "skipped": self.a.recipe.skipped}

"""The Ray actor: one per device, holding one part of the model (a replica, a stage, a filter-split slice).

The driver has the actor group (``rayconv/cluster/group.py``) create the actors, send each its rank,
the routing and the train sharding once (``build``), then make one ``train_step`` call per actor
per step. Inside the step, the actor reads its own data shard, runs its stage program, exchanges
activations and gradients with its neighbours and all-reduces gradients with its data-parallel group,
all through torch.distributed (``parallel/comm.py``): no tensor of the training path passes through
the driver or the Ray object store.

``Actor`` is the actor's entry points; each reads or changes the one ``ActorState`` that ``build``
builds. The rest, one concept a file under ``rayconv/actor/``:

    build.py    ``ActorState`` and ``build_actor``: device, process groups, the part of the model,
                optimizer, compile, CUDA graph, the stage runner and its program
    step.py     ``train_step`` (the step in the order it runs), ``sgd`` (its captured part), ``flush``,
                ``evaluate``
    recipe_step.py   the optimizer's groups, fp16 loss scaling, gradient clipping, the moving average
    batches.py  which micro-batches this actor reads, and what it announces to the loader
    loss.py     the loss of the last stage, micro-batch by micro-batch
    state.py    parameters and rank files in and out; the moving average's weights swapped in
    report.py   metrics: ``materialise``, the per-actor gauges in Ray's metrics, ``memory``, ``trace``
    cuda_graph.py  the whole step as one CUDA graph (``StepGraph``) and its SGD update
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

import ray

from rayconv.actor.rss import RssSampler
from rayconv.cluster.connect import assigned_gpu_index
from rayconv.cluster.watch import Watch
from rayconv.config import Config
from rayconv.errors import DataError
from rayconv.mesh import Mesh
from rayconv.model_names import is_torchvision_model

if TYPE_CHECKING:
    import torch

    from rayconv.actor.build import ActorState
    from rayconv.data.source import Sharding
    from rayconv.parallel.routing import Routing

__all__ = ["Actor"]


def _import_training_modules() -> None:
    """Bind the actor's training modules in this module, in the actor's own process (its ``__init__``,
    after it imported torch): the driver only names ``Actor`` to Ray, so it can start the actors before
    it imports torch itself (``driver.prestart``), and their imports run meanwhile."""
    global train, report, state, comm, build_actor, pick_device, read_ahead, set_up_cuda_libraries, Saver
    from rayconv.actor import report, state, step as train
    from rayconv.actor.saver import Saver
    from rayconv.actor.build import pick_device, build_actor, set_up_cuda_libraries
    from rayconv.data.registry import read_ahead
    from rayconv.parallel import comm


class Actor:
    """One actor of the mesh, created as a Ray actor by the actor group (``rayconv/cluster/group.py``).
    ``a`` is its ``build.ActorState`` (None until ``build``)."""

    def __init__(self, cfg: dict[str, Any], run_name: str, role: str, watch: Optional[str] = None):
        # ``watch``: the Ray job (hex id) of the driver, for an actor that may outlive it (detached, kept
        # on the cluster for the next command: ``cluster.across``), which then ends itself once that
        # driver is gone, or once kept too long (``cluster.watch``); started before anything slow
        self.watch = Watch(watch) if watch is not None else None
        # wall-clock stamps (time.time(), this node's clock) of this process's start-up, for the run's
        # start-up record: the process started, __init__ entered, the training code imported, __init__
        # returned (alive), the warm-up done, build called and returned
        self.stamps = {"process_started": _process_started(), "init": time.time()}
        # The CUDA context made through the driver API in a thread of its own, before torch is imported,
        # while this one imports torch and the training code; the warm-up joins it and has torch take it.
        cuda = None
        if cfg.get("device") == "cuda":
            cuda = threading.Thread(target=_driver_api_context, name="rayconv-cuda-context", daemon=True)
            cuda.start()
        global torch
        import torch

        _import_training_modules()
        self.stamps["imported"] = time.time()
        self._sigterm = signal.getsignal(signal.SIGTERM)   # Ray's, restored by ``renew``
        self._begin(cfg, run_name, role)
        # What ``build`` needs first and costs seconds, done while the driver still checks and plans:
        # torch._dynamo's import where the part is compiled, torchvision's, and on a GPU the CUDA
        # context and cuDNN's and cuBLAS's set-up. ``build`` waits for it before it starts, so no import
        # runs in two threads at once; ``check_model`` waits for the imports only (``_imported``).
        self._imported = threading.Event()
        modules = first_imports(cfg.get("model"), cfg.get("device"), cfg.get("compile"))
        self._warm = threading.Thread(target=_warm_up, args=(cuda, modules, self.stamps, self._imported,
                                                             cfg.get("precision")),
                                      name="rayconv-warm-up", daemon=True)
        self._warm.start()
        self.stamps["alive"] = time.time()

    def _begin(self, cfg: dict[str, Any], run_name: str, role: str) -> None:
        """The state of a new actor of run ``run_name`` (``__init__`` and ``renew``); its data files are
        read on a thread meanwhile (``registry.read_ahead``), which ``build``'s data source then finds
        read (or waits for)."""
        self.cfg = Config(**cfg)
        threading.Thread(target=read_ahead, args=(self.cfg,), name="rayconv-read-ahead", daemon=True).start()
        self.run_name, self.role = run_name, role
        torch.set_num_threads(max(1, self.cfg.num_cpus_per_actor))
        self.a: Optional[ActorState] = None
        self.rss = RssSampler(os.getpid())   # peak RssAnon of this actor and its loader processes
        self.preempted = False   # --elastic: SIGTERM taken; the next step's result says so
        self.saver = Saver()     # this actor's checkpoint part, written in the background (saver.py)
        if self.cfg.elastic is not None:
            self._take_sigterm()

    def renew(self, cfg: dict[str, Any], run_name: str, role: str) -> None:
        """Become a new actor of run ``run_name`` in this process (kept from a run that ended:
        ``cluster.pool``): the previous run's state dropped (model, optimizer, data and its loader
        processes, device memory), its gradient hooks and process groups left, torch.compile's caches
        reset and SIGTERM Ray's again; then as ``__init__(cfg, run_name, role)`` leaves a new actor."""
        self.stamps = {"renewed": time.time()}
        self.rest()
        self._begin(cfg, run_name, role)

    def rest(self) -> None:
        """Drop the previous run's state (as ``renew`` does first) and wait, unused, in its placement
        group until ``renew`` or the group's end: the spare actors of a kept group whose first actors a
        smaller run took (``cluster.pool.take_larger``, ``ActorGroup.park``)."""
        self._warm.join()
        self.shutdown()
        self.rss.stop()
        self.a = None
        gc.collect()
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        try:
            signal.signal(signal.SIGTERM, self._sigterm)
        except (ValueError, TypeError):   # (off the main thread; or a handler Python did not install)
            pass

    def keep(self, key: str, keep_s: float, entry: str) -> Optional[str]:
        """Kept on the cluster after its run ended, for the next command's ``claim`` of ``key`` within
        ``keep_s`` seconds (``cluster.watch.Watch.keep``): this process's code hash; None for an actor
        that cannot outlive its driver (not detached)."""
        return None if self.watch is None else self.watch.keep(key, keep_s, entry)

    def claim(self, key: str, job: str) -> bool:
        """Taken by the command whose driver is Ray job ``job``, when kept for ``key``: True once."""
        return self.watch is not None and self.watch.claim(key, job)

    def _take_sigterm(self) -> None:
        """--elastic: SIGTERM (a spot notice, a drain, ``kill``) sets ``preempted`` instead of ending the
        process; the driver reads it with the next step's metrics, checkpoints at that step boundary
        and stops the actors itself. (Where the call runs off the main thread, SIGTERM stays Ray's.)"""
        def handler(signum, frame):
            self.preempted = True
        try:
            signal.signal(signal.SIGTERM, handler)
        except ValueError:
            pass

    def __repr__(self) -> str:  # the Ray dashboard shows this
        return f"rayconv/{self.run_name}/{self.role}"

    # ------------------------------------------------------------------ bootstrap
    def whereami(self) -> dict[str, Any]:
        """Node id, node IP and GPU ids Ray assigned, for ranking by (node, GPU)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def open_rendezvous(self) -> str:
        """host:port of the process-group rendezvous this actor (rank 0) opens (``comm.open_rendezvous``)."""
        return comm.open_rendezvous(ray.util.get_node_ip_address(), self.cfg.collective_timeout_s)

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
        self.a = build_actor(self.cfg, self.run_name, self.role, rank, master, routing, sharding)
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
            out = train.train_step(self.a, step, lr, profile, t0)
        except DataError as e:
            raise DataError(f"step {step}: {e}") from None
        # (after the step's locals, its autograd graph among them, are freed: that is the actor's
        # time, not time spent waiting for the driver's next call)
        self.a.last_return = time.perf_counter()
        return self._marked(out)

    def _marked(self, out: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        """A step's metrics with ``preempted`` (this actor's role) once it took SIGTERM (``_take_sigterm``),
        and ``saved`` once its checkpoint part is written (``saver.Saver.finished``: the driver's poll)."""
        if out is not None and self.preempted:
            out["preempted"] = self.role
        if out is not None:
            saved = self.saver.finished()
            if saved is not None:
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
        return self._marked(train.flush(self.a))

    def trace(self, first_step: int, steps: int, lr: float) -> dict[str, Any]:
        """``steps`` steps under torch.profiler, then as many under cProfile (``report.trace``)."""
        return report.trace(self.a, self.train_steps, self.flush, first_step, steps, lr)

    def evaluate(self, ema: bool = False, split: str = "test") -> dict[str, Any]:
        """Loss sum (unsmoothed cross entropy) and correct counts over this replica's share of the
        held-out set (each sample once; ``split`` "val": --val-split's images); ``ema``: of the moving average's weights (--model-ema; the
        model's own are restored after, ``state.weights``). Raises RuntimeError for ``ema`` without
        --model-ema."""
        with state.weights(self.a, ema):
            return train.evaluate(self.a, split)

    def inject_overflow(self, step: int) -> None:
        """Test hook: at ``step`` (under --precision fp16), make this actor's first gradient inf after
        the backward pass, as an overflow would (``recipe_step.RecipeStep.before_update``)."""
        self.a.recipe.overflow_at = step

    def loss_scale_state(self) -> Optional[dict[str, Any]]:
        """The float16 loss scale's state (``DynamicLossScale.state_dict``) and whether the last step
        was skipped; None without --precision fp16."""
        scaler = self.a.recipe.scaler
        return None if scaler is None else {**scaler.state_dict(), "skipped": self.a.recipe.skipped}

    # ------------------------------------------------------------------ state (state.py)
    def state(self, ema: bool = False) -> dict[str, torch.Tensor]:
        """``state.state``: this actor's parameters and buffers on CPU (``ema``: the moving average's)."""
        return state.state(self.a, ema)

    def load_state(self, values: dict[str, torch.Tensor]) -> None:
        """``state.load_state``: the inverse of ``state()``."""
        state.load_state(self.a, values)

    def model_keys(self) -> list[tuple[str, tuple[int, ...]]]:
        """The whole model's state_dict keys and shapes as this actor built it (``export.state_keys``)."""
        return self.a.model_keys

    def split_dims(self) -> dict[str, int]:
        """``state.split_dims``: state_dict keys that filter split cuts, and the dimension."""
        return state.split_dims(self.a)

    def rank_file(self) -> bytes:
        """``state.rank_file``: this actor's rank file as ``torch.save`` bytes."""
        return state.rank_file(self.a)

    def checkpoint_start(self, step: int, where: Any) -> None:
        """Copy this actor's part of the checkpoint of ``step`` steps to host memory
        (``state.checkpoint_part``) and return; a background thread writes it to ``where`` (the
        checkpoint's folder: a ``storage.Location`` or a ``cluster.sink.SinkFolder``) as
        ``rank-<rank>.pt``. Waits first for this actor's previous write, if any."""
        self.saver.wait()
        header, tensors, copied = state.checkpoint_part(self.a)
        self.saver.start(step, where / f"rank-{self.a.rank}.pt", header, tensors, copied)

    def checkpoint_wait(self) -> Optional[dict[str, Any]]:
        """The last checkpoint part's result (``saver.Saver``: step and files, or step and error), once
        written; None when this actor wrote none."""
        return self.saver.wait()

    def load_rank_file(self, blob: bytes, next_step: int) -> None:
        """``state.load_rank_file``: load a shard written by ``rank_file``; ``next_step`` comes next."""
        state.load_rank_file(self.a, blob, next_step)

    # ------------------------------------------------------------------ metrics, end
    def memory(self) -> dict[str, Any]:
        """Peak device memory in GiB (``report.memory``) plus the peak RssAnon (MiB) of this actor and
        of its loader processes."""
        return {**report.memory(self.a), **self.rss.peaks()}

    def shutdown(self) -> None:
        """Remove the gradient hooks and leave the process groups (the last call to an actor)."""
        if self.a is not None and self.a.sync is not None:
            self.a.sync.close()
        comm.destroy()


def first_imports(model: object, device: str, compile: str) -> tuple[str, ...]:
    """The modules an actor of ``--model model --device device --compile compile`` imports before it
    builds anything: torch (``__init__``); torch._dynamo where its part may be compiled (``--compile on``,
    or auto off the CPU: ``build``'s rule); torchvision for one of torchvision's models (which imports
    torch._dynamo too)."""
    compiles = compile == "on" or (compile == "auto" and device != "cpu")
    return (("torch",) + (("torch._dynamo",) if compiles else ())
            + (("torchvision",) if is_torchvision_model(model) else ()))


def _warm_up(cuda: Optional[threading.Thread], modules: tuple[str, ...], stamps: dict[str, float],
             imported: threading.Event, precision: Optional[str]) -> None:
    """Import ``modules`` (``first_imports``; torch is imported already), then set ``imported``; wait for the
    CUDA context (``cuda``: the thread making it through the driver API, or None), have torch take it and
    set up the CUDA libraries the first step uses (``build.set_up_cuda_libraries``), ahead of ``build``;
    ``stamps["warmed_up"]``: when all were done (wall clock). A failure here is left for ``build`` to
    meet and report."""
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 - build reports it
        pass
    finally:
        imported.set()
    if cuda is not None:
        cuda.join()
        device = _cuda_context()
        if device is not None:
            set_up_cuda_libraries(device, precision)
    stamps["warmed_up"] = time.time()


def _driver_api_context() -> None:
    """The primary CUDA context of the GPU Ray assigned this actor (``connect.assigned_gpu_index``: the
    driver API numbers the visible devices as torch does) made through the CUDA driver API (libcuda by
    ctypes: ``cuInit``, ``cuDevicePrimaryCtxRetain``), without torch: torch's runtime takes that context at
    its first CUDA call (``_cuda_context``). ctypes lets go of the interpreter during each call, so the
    imports in the actor's main thread go on meanwhile. A failure is left for torch's own first CUDA call."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, context = ctypes.c_int(), ctypes.c_void_p()
        if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), assigned_gpu_index()) == 0:
            cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    except (OSError, RuntimeError):   # (no driver library; no GPU assigned: build reports it)
        pass


def _cuda_context() -> Optional[torch.device]:
    """torch's first CUDA call on the GPU Ray assigned this actor (``connect.assigned_gpu_index``, as
    ``build.pick_device``), which takes the context ``_driver_api_context`` made (or makes it); returns
    that device. A failure (None) is left for ``build``."""
    try:
        device = torch.device("cuda", assigned_gpu_index())
        torch.zeros(1, device=device)
        return device
    except Exception:  # noqa: BLE001 - build reports it
        return None


def _process_started() -> Optional[float]:
    """This process's start as a wall-clock time (``startup.process_start``, moved from the monotonic
    clock to time.time()); None where /proc is absent."""
    from rayconv.startup import process_start

    started = process_start()
    return None if started is None else time.time() - (time.monotonic() - started)

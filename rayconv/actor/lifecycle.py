"""An actor's life apart from training: its process started and warmed up (torch, the training code,
the CUDA context and libraries, on threads while the driver still checks), renewed for another run or
resting (``cluster.pool``), kept on the cluster for the next command (``cluster.watch``), SIGTERM taken
as a preemption notice (--elastic), and its end. ``actor.Actor`` adds the training entries.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

import ray

from rayconv.actor.rss import RssSampler
from rayconv.cluster.connect import assigned_gpu_index
from rayconv.cluster.ship import unpack
from rayconv.cluster.watch import Watch
from rayconv.config import Config
from rayconv.model_names import is_torchvision_model

if TYPE_CHECKING:
    import torch

    from rayconv.actor.build import ActorState


@dataclass(frozen=True)
class TrainingCode:
    """The actor's training code, imported in the actor's own process (``load``, from its ``__init__``):
    the driver only names ``Actor`` to Ray, so it can start the actors before it imports torch itself
    (``driver.early.start_first``), and their imports run meanwhile."""

    torch: ModuleType
    step: ModuleType       # actor/step.py: train_step, flush, evaluate
    report: ModuleType     # actor/report.py: memory, trace
    state: ModuleType      # actor/state.py: parameters and rank files in and out
    comm: ModuleType       # parallel/comm.py: the rendezvous, the process groups left
    precise_bn: ModuleType  # actor/precise_bn.py: batch-norm statistics recomputed before an evaluation
    build_actor: Callable[..., ActorState]
    set_up_cuda_libraries: Callable[..., None]
    read_ahead: Callable[[Config], None]
    saver: Callable[[], Any]   # actor/saver.py's Saver: a checkpoint part written in the background

    @staticmethod
    @functools.cache
    def load() -> "TrainingCode":
        import torch

        from rayconv.actor import precise_bn, report, state, step
        from rayconv.actor.build import build_actor, set_up_cuda_libraries
        from rayconv.actor.saver import Saver
        from rayconv.data.registry import read_ahead
        from rayconv.parallel import comm

        return TrainingCode(torch, step, report, state, comm, precise_bn, build_actor, set_up_cuda_libraries,
                            read_ahead, Saver)


class ActorLifecycle:
    """The life of one actor's process (the module docstring); ``Actor`` is the class Ray runs.
    ``a`` is its ``build.ActorState`` (None until ``build``)."""

    def __init__(self, cfg: dict[str, Any], run_name: str, role: str, watch: Optional[str] = None,
                 modules: Optional[bytes] = None):
        # ``watch``: the Ray job (hex id) of the driver, for an actor that may outlive it (detached, kept
        # on the cluster for the next command: ``cluster.across``), which then ends itself once that
        # driver is gone, or once kept too long (``cluster.watch``); started before anything slow
        self.watch = Watch(watch) if watch is not None else None
        unpack(modules)   # (a user's modules, first on sys.path before anything imports them: cluster.ship)
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
        self.code = TrainingCode.load()   # (torch and the training code)
        self.stamps["imported"] = time.time()
        self._sigterm = signal.getsignal(signal.SIGTERM)   # Ray's, restored by ``renew``
        self._begin(cfg, run_name, role)
        # What ``build`` needs first and costs seconds, done while the driver still checks and plans:
        # torch._dynamo's import where the part is compiled, torchvision's, and on a GPU the CUDA
        # context and cuDNN's and cuBLAS's set-up. ``build`` waits for it before it starts, so no import
        # runs in two threads at once; ``check_model`` waits for the imports only (``_imported``).
        self._imported = threading.Event()
        modules = first_imports(cfg.get("model"), cfg.get("device"), cfg.get("compile"))
        self._warm = threading.Thread(target=_warm_up, args=(self.code, cuda, modules, self.stamps,
                                                             self._imported, cfg.get("precision")),
                                      name="rayconv-warm-up", daemon=True)
        self._warm.start()
        self.stamps["alive"] = time.time()

    def _begin(self, cfg: dict[str, Any], run_name: str, role: str) -> None:
        """The state of a new actor of run ``run_name`` (``__init__`` and ``renew``); its data files are
        read on a thread meanwhile (``registry.read_ahead``), which ``build``'s data source then finds
        read (or waits for)."""
        self.cfg = Config(**cfg)
        threading.Thread(target=self.code.read_ahead, args=(self.cfg,), name="rayconv-read-ahead",
                         daemon=True).start()
        self.run_name, self.role = run_name, role
        self.code.torch.set_num_threads(max(1, self.cfg.num_cpus_per_actor))
        self.a: Optional[ActorState] = None
        self.rss = RssSampler(os.getpid())   # peak RssAnon of this actor and its loader processes
        self.preempted = False   # --elastic: SIGTERM taken; the next step's result says so
        self.saver = self.code.saver()   # this actor's checkpoint part, written in the background (saver.py)
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
        smaller run took (``cluster.pool.take``, ``ActorGroup.rest_after``)."""
        self._warm.join()
        self.shutdown()
        self.rss.stop()
        self.a = None
        gc.collect()
        torch = self.code.torch
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

    def whereami(self) -> dict[str, Any]:
        """Node id, node IP and GPU ids Ray assigned, for ranking by (node, GPU)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def shutdown(self) -> None:
        """Remove the gradient hooks and leave the process groups (the last call to an actor)."""
        if self.a is not None and self.a.sync is not None:
            self.a.sync.close()
        self.code.comm.destroy()


def first_imports(model: object, device: str, compile: str) -> tuple[str, ...]:
    """The modules an actor of ``--model model --device device --compile compile`` imports before it
    builds anything: torch (``__init__``); torch._dynamo where its part may be compiled (``--compile on``,
    or auto off the CPU: ``build``'s rule); torchvision for one of torchvision's models (which imports
    torch._dynamo too)."""
    compiles = compile == "on" or (compile == "auto" and device != "cpu")
    return (("torch",) + (("torch._dynamo",) if compiles else ())
            + (("torchvision",) if is_torchvision_model(model) else ()))


def _warm_up(code: TrainingCode, cuda: Optional[threading.Thread], modules: tuple[str, ...],
             stamps: dict[str, float], imported: threading.Event, precision: Optional[str]) -> None:
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
        device = _cuda_context(code.torch)
        if device is not None:
            code.set_up_cuda_libraries(device, precision)
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


def _cuda_context(torch: ModuleType) -> Optional[torch.device]:
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

"""Measuring one layout: start its actors, warm up, time steps, split a step into its costs.

``measure`` runs ``--warmup`` steps (through the first epoch's end when that epoch ends in a partial
batch: ``warmup_steps``), then ``--steps`` timed steps driven as the driver's loop drives
them (the next step queued before waiting), the same steps again looped inside the actors (one
call, for the driver's overhead), reads peak memory, then profiles a few steps that split the step
into compute, receive wait, all-reduce wait and exposed exchange time (profiled steps run eagerly,
synchronised around each wait, also where the timed steps replay a CUDA graph; peak memory is read
before them), and optionally traces rank 0 with torch.profiler. ``base_config`` is the run
configuration the bench gives every layout.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from rayconv.actor.actor import Actor
from rayconv.config import Config
from rayconv.driver.job import launch
from rayconv.driver.resolve import call_timeout_s as default_call_timeout_s, resolve_on_cluster
from rayconv.errors import CallTimeout, ClusterError
from rayconv.files import atomic_write
from rayconv.layout import Layout
from rayconv.parallel.pipeline import bubble_fraction
from rayconv.storage import Place


# The bench calls each step itself, as many as it times: its run has no end the actors should see (they
# announce each next epoch to the source ahead, as in the middle of a run: ``actor.batches``).
BENCH_EPOCHS = 1_000_000


def base_config(args, model: str, layout: Layout, global_batch: int) -> Config:
    """The validated Config the bench runs ``layout`` of ``model`` with (its flags ``args``: data,
    precision, device, compile, CUDA graphs); synthetic data has 1000 classes. Raises ConfigError."""
    data = dict(data="synthetic", num_classes=1000, synthetic_samples=max(global_batch * 4, 1024)) \
        if args.data == "synthetic" else \
        dict(data=args.data, data_dir=args.data_dir, loader_workers=args.loader_workers, decode=args.decode,
             data_on_device=args.data_on_device)
    kw: dict[str, Any] = dict(model=model, **data, image_size=args.image_size, global_batch_size=global_batch,
                              precision=args.precision, device=args.device, address=args.address,
                              progress=False, lr=0.01, compile=args.compile,
                              cuda_graphs=args.cuda_graphs, all_gpus_visible=args.all_gpus_visible,
                              # (steady images/s: cuDNN's timed choice, as the anchors')
                              cudnn_benchmark="on",
                              epochs=BENCH_EPOCHS)
    kw.update(layout.to_config_fields())
    return Config(**kw).validate()


@dataclass
class _Calls:
    """The calls to one layout's actors, each within ``limit`` seconds; ``phase`` names the last one
    (for the error message of a call that fails)."""

    actor_group: Any
    lr: float
    limit: float
    phase: str = "warm-up step 0"

    def call(self, phase: str, method: Callable[..., Any], *args: Any) -> Any:
        self.phase = phase
        return self.actor_group.call(method, *args, timeout_s=self.limit)


# the warm-up runs through the first epochs' partial batches for epochs of at most this many steps
WARMUP_EPOCH_MAX = 1000


def warmup_steps(warmup: int, sharding, graphs: bool = False) -> int:
    """The warm-up's steps: ``warmup``, or, when the epoch ends in a partial batch and has more steps than
    ``warmup`` but at most ``WARMUP_EPOCH_MAX``, the whole first epoch (with whole-step CUDA graphs,
    ``graphs``, the first two). A partial batch's first step pays its shape's one-time set-up (it runs
    eagerly: cuDNN's plans for each convolution of the new shape, the batch's augmentation captured
    again: seconds on a GPU), and under CUDA graphs the second is captured
    (``actor.cuda_graph.StepGraph``): inside the timed steps otherwise; the later epochs' ends, which
    recur, are timed."""
    spe = sharding.steps_per_epoch
    partial = sharding.train_samples % sharding.global_batch_size != 0
    return (2 if graphs else 1) * spe if partial and warmup < spe <= WARMUP_EPOCH_MAX else warmup


def measure(cfg: Config, warmup: int, steps: int, profile_steps: int = 3, trace_steps: int = 0,
            trace_to: Optional[Place] = None, call_timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Images/s and step time of ``cfg`` over ``steps`` timed steps after ``warmup`` steps (or the first
    epoch: ``warmup_steps``), then a
    profiled split, then (``trace_steps`` > 0) a torch.profiler trace of rank 0 written as a table to
    ``trace_to``. Returns one bench row's measured columns (``bench.table.BENCH_SCHEMA``).

    Every call to the actors (one step, or the in-actor loop of ``steps`` steps) must return within
    ``call_timeout_s`` seconds (default ``driver.resolve.call_timeout_s(cfg)``, as ``rayconv.run``);
    otherwise the actors are stopped. Raises ClusterError (out of memory, an actor's error) or its
    subclass CallTimeout (a call past its limit), the message prefixed with the phase it happened in
    (e.g. ``warm-up step 0``)."""
    started = time.monotonic()  # the row's to_first_step_s: from here to warm-up step 0 done
    cfg, mesh, _, routing, sharding = resolve_on_cluster(cfg)  # cfg resolved against the cluster (device, dp)
    limit = call_timeout_s if call_timeout_s is not None else default_call_timeout_s(cfg)
    actor_group, reports = launch(cfg, mesh, routing, sharding,
                                  f"bench-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    calls = _Calls(actor_group, cfg.lr, limit)
    warmup = warmup_steps(warmup, sharding, graphs=bool(reports[0].get("cuda_graphs")))
    try:
        warm_from = time.monotonic()
        got: dict[str, Any] = _warm_up(calls, warmup, compiles=bool(reports[0].get("compiled")))
        if got["first_step_s"] is not None:
            got["to_first_step_s"] = warm_from - started + got["first_step_s"]
        got.update(_timed(calls, warmup, steps), warmup_steps=warmup)
        first_prof = warmup + 2 * steps
        got["prof"] = _profiled(calls, first_prof, profile_steps)
        got["device_busy"] = (_trace(calls, first_prof + profile_steps, trace_steps, trace_to)
                              if trace_steps else None)
    except CallTimeout as e:
        raise CallTimeout(f"{calls.phase}: {e}; if it is only slow, raise --call-timeout-s",
                          recoverable=True) from e
    except ClusterError as e:
        raise ClusterError(f"{calls.phase}: {e}", recoverable=e.recoverable) from e
    finally:
        actor_group.kill()
    return _row(cfg, mesh, routing, reports, steps, got)


def _warm_up(calls: _Calls, warmup: int, compiles: bool) -> dict[str, Any]:
    """The warm-up steps, one at a time (compilation and autotuning happen here): their seconds, and
    the first step's."""
    t0 = time.perf_counter()
    first_step_s = None
    for s in range(warmup):
        calls.call(f"warm-up step {s}" + (" (compiles)" if s == 0 and compiles else ""), Actor.train_step, s,
                   calls.lr)
        if s == 0:
            calls.call("warm-up step 0", Actor.flush)
            first_step_s = time.perf_counter() - t0
    calls.call(f"warm-up step {max(0, warmup - 1)}", Actor.flush)
    return {"warmup_s": time.perf_counter() - t0, "first_step_s": first_step_s}


def _timed(calls: _Calls, warmup: int, steps: int) -> dict[str, Any]:
    """The timed steps as the driver's loop runs them (the next step queued before waiting for the
    current one), the same steps looped inside the actors, and the peak memory of the timed steps."""
    actor_group, lr, end = calls.actor_group, calls.lr, warmup + steps
    t0 = time.perf_counter()
    results, done_at = [], []
    in_flight = actor_group.submit(Actor.train_step, warmup, lr)
    for s in range(warmup, end):
        calls.phase = f"timed step {s}"
        queued = actor_group.submit(Actor.train_step, s + 1, lr) if s + 1 < end else None
        current, in_flight = in_flight, queued
        results.append(actor_group.collect(current, timeout_s=calls.limit))
        done_at.append(time.perf_counter())
    results.append(calls.call(f"timed step {end - 1}", Actor.flush))
    elapsed = time.perf_counter() - t0
    # The same steps with no driver call between them (each actor loops by itself; one call).
    t1 = time.perf_counter()
    calls.call(f"in-actor loop of {steps} steps", Actor.train_steps, end, steps, lr)
    in_actor_s = time.perf_counter() - t1
    # Peak memory of the timed steps (the profiled ones run eagerly, outside any CUDA graph).
    memory = calls.call("memory report", Actor.memory)
    # (each step's collect after the one before: the driver loop's step times)
    gaps = np.diff([t0] + done_at)
    return {"results": results, "elapsed": elapsed, "in_actor_s": in_actor_s, "memory": memory,
            "median_s": float(np.median(gaps)) if len(gaps) else None, "gaps_s": gaps.tolist()}


def _profiled(calls: _Calls, first: int, n: int) -> list:
    """``n`` profiled steps (eager, synchronised around each wait): each one's per-actor split."""
    prof = []
    for s in range(first, first + n):
        calls.call(f"profiled step {s}", Actor.train_step, s, calls.lr, True)
        prof.append(calls.call(f"profiled step {s}", Actor.flush))
    return prof


def _trace(calls: _Calls, first: int, trace_steps: int, trace_to: Optional[Place]) -> Optional[float]:
    """Trace ``trace_steps`` steps of rank 0; write its table to ``trace_to``; the device's busy share."""
    tr = calls.call("trace", Actor.trace, first, trace_steps, calls.lr)[0]
    if trace_to is not None:
        kernels = "not measured" if tr["device_ms"] is None else f"{tr['device_ms']:.1f} ms"
        atomic_write(trace_to, lambda tmp: Path(tmp).write_text(
            f"rank 0, {trace_steps} steps, wall {tr['wall_ms']:.1f} ms (with the profiler's own overhead), "
            f"device kernels {kernels}\n{tr['table']}\n"))
    return None if tr["device_ms"] is None else tr["device_ms"] / tr["wall_ms"]


def _mean(vals: list[float]) -> Optional[float]:
    return sum(vals) / len(vals) if vals else None


def _row(cfg: Config, mesh, routing, reports: list[dict], steps: int, got: dict[str, Any]) -> dict[str, Any]:
    """The measured columns of a bench row from what ``measure`` gathered."""
    results, prof, elapsed = got["results"], got["prof"], got["elapsed"]
    complete = [rs for rs in results if rs and all(r is not None for r in rs)]
    # Driver overhead: per step, the least time any actor waited for the driver's next call (the
    # actor that finished last waited only for the driver's round trip).
    idle = [min(r["idle_ms"] for r in rs) for rs in complete if all(r.get("idle_ms") is not None for r in rs)]
    # Input stall per step: the longest wait for a batch not overlapped with compute (steptime.py).
    stalls = [max(r.get("input_stall_ms") or 0.0 for r in rs) for rs in complete]
    step_ms = elapsed / steps * 1e3

    def prof_mean(key: str) -> Optional[float]:  # the slowest actor's, averaged over profiled steps
        return _mean([max(r[key] for r in rs) for rs in prof if rs and rs[0].get(key) is not None])

    # Communication volume of a step (the last profiled one; every step of a run sends the same), in MB
    # (2**20 bytes): the most any actor handed to torch.distributed, and all actors together.
    sent = [r.get("comm_bytes") for r in (prof[-1] if prof else None) or []]
    known = sent and all(b is not None for b in sent)
    peaks = [m["peak_gib"] for m in got["memory"]]
    stall = _mean(stalls)
    return {"images_per_s": cfg.global_batch_size * steps / elapsed, "step_ms": step_ms,
            "step_ms_median": None if got.get("median_s") is None else got["median_s"] * 1e3,
            "timed_step_ms": json.dumps([round(g * 1e3, 3) for g in got.get("gaps_s") or []]),
            "warmup_s": got["warmup_s"], "warmup_steps": got["warmup_steps"],
            "first_step_s": got["first_step_s"], "to_first_step_s": got.get("to_first_step_s"),
            "compiled": bool(reports[0].get("compiled")), "cuda_graphs": bool(reports[0].get("cuda_graphs")),
            "peak_gib_max": max(peaks) if all(p is not None for p in peaks) else None,
            "peak_gib_per_actor": json.dumps([None if p is None else round(p, 3) for p in peaks]),
            "params_per_actor": json.dumps([s["parameters"] for s in reports]),
            "compute_ms": prof_mean("compute_ms"), "recv_wait_ms": prof_mean("wait_ms"),
            "allreduce_wait_ms": prof_mean("allreduce_ms"), "exchange_exposed_ms": prof_mean("exchange_ms"),
            "driver_idle_ms": _mean(idle), "input_stall_ms": stall,
            "input_stall_fraction": stall / step_ms if stall is not None else None,
            "comm_mb_per_step": max(sent) / 2**20 if known else None,
            "comm_mb_per_step_total": sum(sent) / 2**20 if known else None,
            "in_actor_step_ms": got["in_actor_s"] / steps * 1e3,
            "driver_overhead": 1 - got["in_actor_s"] / elapsed, "device_busy": got["device_busy"],
            "bubble_fraction": bubble_fraction(routing.schedule) if mesh.pp > 1 else 0.0,
            "num_microbatches": cfg.num_microbatches, "schedule": cfg.schedule if mesh.pp > 1 else None,
            "virtual_stages": cfg.virtual_stages,
            "exchange_chunks": cfg.exchange_chunks if mesh.fs > 1 else None, "world_size": mesh.world_size}


__all__ = ["measure", "base_config"]

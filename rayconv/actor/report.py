"""Metrics of an actor: a step's device scalars to Python numbers (``materialise``), the per-actor
gauges in Ray's metrics (``report_gauges``), peak device memory (``memory``) and the profiled steps of
``trace``. Each reads the actor's ``build.ActorState``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Any, Callable, Optional

import torch

from rayconv.actor.build import ActorState
from rayconv.outputs.metrics import actor_gauges
from rayconv.parallel.comm import sync_device


def memory(a: ActorState) -> dict[str, Any]:
    """Peak device memory in GiB (CUDA only; None on CPU)."""
    if a.device.type != "cuda":
        return {"rank": a.rank, "peak_gib": None}
    return {"rank": a.rank, "peak_gib": torch.cuda.max_memory_allocated(a.device) / 2**30}


GAUGE_S = 0.5   # an actor sets its gauges at most this often (seconds); Prometheus scrapes every few seconds


def report_gauges(a: ActorState, result: Optional[dict[str, Any]], force: bool = False) -> None:
    """Per-actor gauges in Ray's metrics (dashboard Metrics view): images/s, step ms, loss, peak memory,
    from the step ``result``; at most every ``GAUGE_S`` seconds unless ``force`` (a short step's host
    time can bound the GPU, and setting four gauges and reading the allocator's statistics each step
    adds to it)."""
    if not a.cfg.metrics or result is None or not result.get("interval_ms"):
        return
    now = time.perf_counter()
    if not force and a.gauges_at is not None and now - a.gauges_at < GAUGE_S:
        return
    a.gauges_at = now
    ms = result["interval_ms"]
    peak = torch.cuda.max_memory_allocated(a.device) / 2**30 if a.device.type == "cuda" else None
    loss = result["loss_sum"] / max(1, result["samples"]) if result["reports"] else None
    actor_gauges(a.run_name, a.role, images_per_s=result["samples"] / max(ms / 1e3, 1e-9),
                 step_ms=ms, loss=loss, peak_memory_gib=peak, step=result["step"])


def materialise(m: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Device scalars of a step's metrics to Python numbers (waits for that step only)."""
    if m is None:
        return None
    event, clock = m.pop("event", None), m.pop("clock", None)
    if event is not None:
        event.synchronize()
    return {**m, "loss_sum": float(m["loss_sum"]), "correct": int(m["correct"]),
            **(clock.read() if clock else {})}


def trace(a: ActorState, train_steps: Callable[[int, int, float], object], flush: Callable[[], object],
          first_step: int, steps: int, lr: float) -> dict[str, Any]:
    """Run ``steps`` steps (``train_steps(first, n, lr)``, after ``flush()``) under torch.profiler,
    then ``steps`` more under cProfile. Returns the wall time (ms) of the first ``steps``, the summed
    device kernel time (ms; NCCL kernels overlap compute, so it may exceed the wall time) and, as
    text, the profiler's table of the most expensive operators (self device time on GPUs, self CPU
    time otherwise) and cProfile's of the actor's Python functions (by own time, then by cumulative time)."""
    # (imports triton: only for a trace)
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = a.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    flush()
    sync_device(a.device)
    t0 = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        train_steps(first_step, steps, lr)
        sync_device(a.device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    # The actor's Python side over as many more steps: where the CPU's time goes when the device waits.
    py = cProfile.Profile()
    py.enable()
    train_steps(first_step + steps, steps, lr)
    sync_device(a.device)
    py.disable()
    py_table = io.StringIO()
    pstats.Stats(py, stream=py_table).sort_stats("tottime").print_stats(25)
    py_table.write("\nBy cumulative time (what each function's calls cost, callees included):\n")
    pstats.Stats(py, stream=py_table).sort_stats("cumulative").print_stats(40)
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in events) if cuda else None
    return {"rank": a.rank, "wall_ms": wall_ms, "steps": steps,
            "device_ms": kernel_us / 1e3 if kernel_us is not None else None,
            "table": events.table(sort_by=key, row_limit=30) + "\n\nPython profile (cProfile, "
            f"{steps} more steps, by own time):\n" + py_table.getvalue()}

"""Metrics of an actor: a step's device scalars to Python numbers (``materialise``), the per-actor
gauges in Ray's metrics (``ReportMixin._report``) and peak device memory (``memory``).
``ReportMixin`` is inherited by ``rayconv/actor/worker.py``'s ``Worker``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rayconv.outputs.metrics import actor_gauges


class ReportMixin:
    """The metrics calls of ``Worker``: ``memory`` and the dashboard gauges."""

    def memory(self) -> dict[str, Any]:
        """Peak device memory in GiB (CUDA only; None on CPU)."""
        if self.device.type != "cuda":
            return {"rank": self.rank, "peak_gib": None}
        return {"rank": self.rank, "peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}

    def _report(self, result: Optional[dict[str, Any]]) -> None:
        """Per-actor gauges in Ray's metrics (dashboard Metrics view): images/s, step ms, loss, peak memory."""
        if not self.cfg.metrics or result is None or not result.get("interval_ms"):
            return
        ms = result["interval_ms"]
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        loss = result["loss_sum"] / max(1, result["samples"]) if result["reports"] else None
        actor_gauges(self.run_name, self.role, images_per_s=result["samples"] / max(ms / 1e3, 1e-9),
                     step_ms=ms, loss=loss, peak_memory_gib=peak, step=result["step"])


def materialise(m: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Device scalars of a step's metrics to Python numbers (waits for that step only)."""
    if m is None:
        return None
    event, clock = m.pop("event", None), m.pop("clock", None)
    if event is not None:
        event.synchronize()
    return {**m, "loss_sum": float(m["loss_sum"]), "correct": int(m["correct"]), **(clock.read() if clock else {})}

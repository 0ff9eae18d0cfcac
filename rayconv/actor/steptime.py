"""Each training step's own time and input stall, measured inside the actor.

With two steps in flight (the driver queues step k+1 before step k's result comes back), the
driver's wall time between two results can belong partly to a neighbouring step, most visibly
around an evaluation or a checkpoint. The actor times its own steps instead:

* ``step_ms``: on CUDA, device time from the step's start marker to its end marker on the stream
  (the gaps between steps, when the device waits for the driver's next call, are not the step's); on
  CPU, where the step runs inside the call, the call's wall time.
* ``input_stall_ms``: the part of obtaining the step's batch (waiting for the data loader, decode,
  the host-to-device copy) not overlapped with compute. On CUDA, device time between markers put on
  the stream just before and just after the batch is obtained: while the previous step still runs,
  the first marker waits behind it, so only the wait the device sees counts. On CPU, the wall time
  of the wait. Zero on actors that read no input (later pipeline stages).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch


class StepClock:
    """Markers of one step: ``start()``, ``input_begin()`` / ``input_end()`` around the batch,
    ``end()``; ``read()`` (after the step's work has finished) gives {"step_ms", "input_stall_ms"}."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, Any] = {}
        # (the step's stream, looked up once: each Event.record() without one looks it up again)
        self.stream = torch.cuda.current_stream(device) if self.cuda else None

    def _mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.marks[name] = ev
        else:
            self.marks[name] = time.perf_counter()

    def start(self) -> None:
        self._mark("start")

    def input_begin(self) -> None:
        self._mark("input_begin")

    def input_end(self) -> None:
        self._mark("input_end")

    def end(self) -> None:
        self._mark("end")

    def _ms(self, a: str, b: str) -> Optional[float]:
        if a not in self.marks or b not in self.marks:
            return None
        if self.cuda:
            self.marks[b].synchronize()
            return float(self.marks[a].elapsed_time(self.marks[b]))
        return (self.marks[b] - self.marks[a]) * 1e3

    def read(self) -> dict[str, Optional[float]]:
        """The step's time and input stall in ms (waits for the step's end marker on CUDA)."""
        return {"step_ms": self._ms("start", "end"),
                "input_stall_ms": self._ms("input_begin", "input_end") or 0.0}

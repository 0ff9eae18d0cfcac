"""Time to accuracy (``--target-accuracy A``): when the first evaluation whose test top-1 reached A
came, in wall-clock seconds and in training seconds, and the first steps' time reported apart.

Time to a fixed accuracy is the figure of merit of DAWNBench (Coleman et al. 2017) and MLPerf
Training (Mattson et al. 2020): throughput alone rewards a layout that trains fast but learns less
per image. ``time_to_target_s`` counts from the start of ``fit`` (setup, actor start, evaluations and
checkpoints included); ``time_to_target_train_s`` only the steps' driver wall-clock up to the
evaluation (``Run.wall``, which leaves evaluation and checkpoint time out); ``time_to_target_since_s``
from where the start-up record counts from (``startup.since``: the command for ``python -m rayconv.run``,
so that the imports, Ray and the actors' start count too); ``first_steps_s`` is the
wall time of the first two steps, where compilation and CUDA-graph capture happen, so that a reader
can tell start-up cost from steady training. Times are of this process (a resumed run counts its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

FIRST_STEPS = 2  # the steps that compile (torch.compile) and capture (CUDA graphs)


def train_seconds(wall: dict[int, tuple[int, float]], upto: int) -> float:
    """Driver wall-clock seconds of the steps ``<= upto`` in ``wall`` (step -> (images, seconds))."""
    return sum(seconds for step, (_, seconds) in wall.items() if step <= upto)


def first_steps_s(wall: dict[int, tuple[int, float]]) -> Optional[float]:
    """Wall-clock seconds of the first ``FIRST_STEPS`` steps this process ran (None before any)."""
    first = sorted(wall)[:FIRST_STEPS]
    return sum(wall[k][1] for k in first) if first else None


@dataclass
class Target:
    """The target accuracy (None: no target) and, once reached, the step and times it was reached at."""

    accuracy: Optional[float]
    step: Optional[int] = None
    wall_s: Optional[float] = None   # seconds from the start of fit
    train_s: Optional[float] = None  # training seconds (the steps' wall-clock)
    since_s: Optional[float] = None  # seconds from the start-up record's origin (the command)

    def update(self, step: int, test_accuracy: Optional[float], wall_s: float, train_s: float,
               since_s: Optional[float] = None) -> bool:
        """Record the evaluation after ``step`` if it is the first to reach the target; True then."""
        if (
            self.accuracy is None
            or self.step is not None
            or test_accuracy is None
            or test_accuracy < self.accuracy
        ):
            return False
        self.step, self.wall_s, self.train_s, self.since_s = step, wall_s, train_s, since_s
        return True

    def summary(self, wall: dict[int, tuple[int, float]]) -> dict[str, Any]:
        """summary.json's keys: ``target_accuracy``, ``target_step`` (the step after which the target was
        reached), ``time_to_target_s``, ``time_to_target_train_s``, ``time_to_target_since_s`` (null when
        never reached or no target) and ``first_steps_s``."""
        return {"target_accuracy": self.accuracy, "target_step": self.step, "time_to_target_s": self.wall_s,
                "time_to_target_train_s": self.train_s, "time_to_target_since_s": self.since_s,
                "first_steps_s": first_steps_s(wall)}

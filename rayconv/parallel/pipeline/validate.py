"""Pipeline step programs as data: which stage runs which forward/backward, in what order, and
what it sends and receives around each.

Where each piece lives:

* ``programs.py`` -- actions (``F3``, ``B3``, ``F3c1``), ``Schedule``, the schedules (GPipe, 1F1B,
  interleaved 1F1B, ``forward_only``), ``make_schedule``, ``peak_in_flight``;
* ``simulate.py`` -- when actions run: ``timeline`` (unit or measured times), the unit-time
  ``simulate`` grid, ``bubble_fraction``, ``format_grid``;
* ``exchange.py`` -- the batches of sends and receives a stage posts (``exchange_plan``, ``Post``)
  and ``check_exchanges``, which replays them;
* ``nccl_model.py`` -- the replay model of NCCL's point-to-point rules those checks run on;
* here -- ``validate``, which runs both checks.

Each module's docstring gives its model and sources (GPipe: Huang et al. 2019, arXiv:1811.06965;
1F1B and interleaving: Narayanan et al. 2021, PipeDream-Flush and Megatron-LM).
"""

from __future__ import annotations

from rayconv.parallel.pipeline.p2p import Post, check_exchanges, exchange_plan
from rayconv.parallel.pipeline.schedules import SCHEDULE_NAMES, Action, Schedule, forward_only, gpipe, interleaved_1f1b, make_schedule, one_f_one_b, peak_in_flight
from rayconv.errors import ScheduleError
from rayconv.parallel.pipeline.simulate import bubble_fraction, format_grid, simulate, timeline

__all__ = [
    "Action", "Schedule", "ScheduleError", "SCHEDULE_NAMES", "gpipe", "one_f_one_b", "interleaved_1f1b",
    "forward_only", "make_schedule", "validate", "simulate", "timeline", "Post", "exchange_plan",
    "check_exchanges", "bubble_fraction", "peak_in_flight", "format_grid",
]


def validate(schedule: Schedule) -> None:
    """Check a schedule; return ``None`` if it is runnable.

    Raises:
        ScheduleError: if the number of programs differs from ``num_stages``; a
            stage's program does not contain exactly one ``F(m)`` and one ``B(m)``
            for each micro-batch ``0..M-1``; a ``B(m)`` precedes ``F(m)`` on a stage;
            the schedule deadlocks under the blocking-receive model (``simulate``); or its
            exchanges, as the pipeline posts them, deadlock or mismatch messages under NCCL's
            rules (``check_exchanges``).
    """
    simulate(schedule)
    check_exchanges(schedule)

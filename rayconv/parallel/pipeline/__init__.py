"""Pipeline parallelism: step programs as data, and the stage that runs them.

Where each piece lives:

* ``schedules`` -- actions (``F3``, ``B3``, ``F3c1``), ``Schedule``, the schedules (GPipe, 1F1B,
  interleaved 1F1B, ``forward_only``), ``make_schedule``, ``peak_in_flight``;
* ``simulate`` -- when actions run: ``timeline`` (unit or measured times), the unit-time
  ``simulate`` grid, ``bubble_fraction``, ``format_grid``;
* ``p2p`` -- the batches of sends and receives a stage posts (``p2p_posts``, ``Post``);
* ``nccl_model`` -- the replay model of NCCL's point-to-point rules (``p2p`` splits batches by it,
  ``checks`` replays them on it);
* ``checks`` -- the checks a schedule passes before any actor runs it: ``check_exchanges`` (the
  batches replayed) and ``validate``, which runs it and ``simulate``'s;
* ``stages`` -- the layer list cut into stages (``balance``, ``parse_stages``);
* ``runner`` -- ``StageRunner``, which runs one stage's program in an actor (``Chunk``, ``StepResult``).

Each module's docstring gives its model and sources (GPipe: Huang et al. 2019, arXiv:1811.06965;
1F1B and interleaving: Narayanan et al. 2021, PipeDream-Flush and Megatron-LM). Everything re-exported
here is plain Python, so the planner imports it without torch; ``runner`` (torch, torch.distributed)
is imported by its own path.
"""

from rayconv.errors import ScheduleError
from rayconv.parallel.pipeline.checks import check_exchanges, validate
from rayconv.parallel.pipeline.p2p import Post, p2p_posts
from rayconv.parallel.pipeline.schedules import (SCHEDULE_NAMES, Action, Schedule, forward_only, gpipe,
                                                 interleaved_1f1b, make_schedule, one_f_one_b, peak_in_flight)
from rayconv.parallel.pipeline.simulate import bubble_fraction, format_grid, simulate, timeline
from rayconv.parallel.pipeline.stages import balance, parse_stages

__all__ = [
    "Action", "Schedule", "ScheduleError", "SCHEDULE_NAMES", "gpipe", "one_f_one_b", "interleaved_1f1b",
    "forward_only", "make_schedule", "validate", "simulate", "timeline", "Post", "p2p_posts",
    "check_exchanges", "bubble_fraction", "peak_in_flight", "format_grid", "balance", "parse_stages",
]

"""``validate``: the one check a pipeline schedule passes before any actor runs it (both of the models
of ``simulate`` and ``nccl_model`` that it must satisfy)."""

from __future__ import annotations

from rayconv.parallel.pipeline.p2p import check_exchanges
from rayconv.parallel.pipeline.schedules import Schedule
from rayconv.parallel.pipeline.simulate import simulate


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

"""The checks a pipeline schedule passes before any actor runs it: ``validate`` (both of the models of
``simulate`` and ``nccl_model`` that it must satisfy) and ``check_exchanges`` (the batches of
``p2p.p2p_posts`` replayed under NCCL's point-to-point rules, ``nccl_model.py``)."""

from __future__ import annotations

from rayconv.errors import ScheduleError
from rayconv.parallel.pipeline.nccl_model import counterparts, host_events, replay
from rayconv.parallel.pipeline.p2p import stage_posts
from rayconv.parallel.pipeline.schedules import Schedule, check_programs
from rayconv.parallel.pipeline.simulate import simulate

__all__ = ["validate", "check_exchanges"]


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


def check_exchanges(schedule: Schedule, paired: bool = True) -> None:
    """Replay the point-to-point batches a step posts under NCCL's rules (``nccl_model.py``).

    With ``paired`` the batches are ``p2p_posts``'s, what ``StageRunner.run`` posts. With
    ``paired=False``, the unpaired pattern: each receive and each send is a batch of its own, the
    send posted right after its action computes (1F1B deadlocks that way; the paired plan does not).

    The model, per stage: compute runs the program's actions in order; an action computes once the
    batch holding its receive has completed (waiting on a batch waits on all of it). A batch starts
    once everything computed before it was posted has run and the stage's previous batch has
    completed (one communication stream). The k-th message from stage a to stage b is the k-th
    receive b posts from a. A batch goes through as one unit (an NCCL group: its connections to new
    peers are set up, on the host, before any of its operations start, and its send and receive with
    one peer run fused): it is *armed* once it has started and the batch of every operation's
    counterpart has started too, and an operation and its counterpart match once both their batches
    are armed. A batch completes when all its operations have matched. Nothing is buffered.

    Raises:
        ScheduleError: if the programs are malformed (see ``validate``); if the k-th message
            between two stages is not the one the receiver expects (it would receive another
            micro-batch's data); or if the batches deadlock (the message names what each stuck
            stage waits for).
    """
    check_programs(schedule)
    events = host_events(schedule, stage_posts(schedule) if paired else None)
    stuck = replay(events, counterparts(schedule, events))
    if stuck:
        def waits(s: int, j: int) -> str:
            return ", ".join(f"{op[0]} {op[1][0]}{op[1][1]} {'to' if op[0] == 'send' else 'from'} stage "
                             f"{op[1][3] if op[0] == 'send' else op[1][2]}" for op in events[s][j][1]
                             if not op[2])
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks when sends are not buffered "
                            f"({'paired' if paired else 'unpaired'} exchanges): "
                            + "; ".join(f"stage {s} waits on [{waits(s, j)}]" for s, j in stuck))

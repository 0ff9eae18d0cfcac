"""When each action of a pipeline schedule runs: its timeline, the unit-time grid, the bubble.

Communication model (``timeline``, ``simulate``)
------------------------------------------------
* ``F(m)`` on stage ``s > 0`` waits until stage ``s - 1`` has completed ``F(m)`` (it receives that
  activation); with chunks, until the previous *virtual* stage has.
* ``B(m)`` on stage ``s < P - 1`` waits until stage ``s + 1`` has completed ``B(m)`` (it receives that
  gradient); with chunks, the next virtual stage.
* Sends are non-blocking (buffered), so they never wait; a message takes ``link`` time to arrive.
* A stage runs its program in order, each action as soon as it can.

With every action taking one tick and free links this is the ideal unit-time model (F = B = 1) in
which GPipe's bubble is ``(P - 1) / (M + P - 1)`` (Huang et al. 2019, arXiv:1811.06965, section 2.2)
and 1F1B's the same (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2.1). With measured per-stage times it predicts a step
(``benchmarks/stage_times.py``). Whether the exchanges complete when sends do not buffer is
``checks.check_exchanges``'s question.

Legend for ``format_grid``: ``F3`` = forward of micro-batch 3, ``B3`` = backward of micro-batch 3,
``F3c1`` = on model chunk 1, ``.`` = stage idle for that tick.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rayconv.parallel.pipeline.schedules import BACKWARD, FORWARD, Action, Schedule, check_programs
from rayconv.errors import ScheduleError

__all__ = ["timeline", "simulate", "bubble_fraction", "format_grid"]


def _dependency(schedule: Schedule, stage: int, action: Action) -> tuple[int, Action] | None:
    """The (stage, action) that must complete before ``action`` can run on ``stage``, if any: the
    same action of the previous virtual stage (forward) or the next one (backward)."""
    P = schedule.num_stages
    v = action.chunk * P + stage
    if action.kind == FORWARD and v > 0:
        return (v - 1) % P, Action(FORWARD, action.microbatch, (v - 1) // P)
    if action.kind == BACKWARD and v < P * schedule.virtual_stages - 1:
        return (v + 1) % P, Action(BACKWARD, action.microbatch, (v + 1) // P)
    return None


def timeline(schedule: Schedule, forward: Optional[Sequence[float]] = None,
             backward: Optional[Sequence[float]] = None,
             link: float | Sequence[float] = 0) -> list[list[tuple[float, float]]]:
    """When each action runs: per stage, ``(start, finish)`` of each action of its program, in order.

    An action starts once its stage has finished the action before it and its input has arrived:
    the finish of the action it depends on (see the communication model) plus ``link``.

    Args:
        forward, backward: how long one forward / backward takes (any one unit, e.g. ms): one entry per
            stage ``s`` (each chunk of an interleaved stage alike), or one per virtual stage
            ``v = chunk * P + s`` (``P * V`` entries). Left out: 1 each, the unit-time model.
        link: the time one activation or gradient takes from stage to stage (same unit), ``>= 0``: one
            figure for every boundary, or one per boundary ``b`` between virtual stages ``b`` and ``b + 1``.

    Returns:
        One list per stage of ``(start, finish)`` pairs, one per action of its program. The step takes
        the largest finish. In the unit-time model every time is a whole tick.

    Raises:
        ScheduleError: if the programs are malformed (see ``validate``) or the schedule deadlocks
            (the message names each stage's stuck action).
    """
    check_programs(schedule)
    P = schedule.num_stages
    VP = P * schedule.virtual_stages
    fwd = [1] * P if forward is None else list(forward)
    bwd = [1] * P if backward is None else list(backward)
    fwd, bwd = (t * schedule.virtual_stages if len(t) == P else t for t in (fwd, bwd))  # per virtual stage
    links = [link] * max(VP - 1, 1) if isinstance(link, (int, float)) else list(link)
    assert len(fwd) == len(bwd) == VP and len(links) >= VP - 1, "one time per stage or per virtual stage"
    finish: dict[tuple[int, Action], float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in range(P)]
    free: list[float] = [0] * P  # when each stage finishes its last action so far
    progressed = True
    while progressed:
        progressed = False
        for s, prog in enumerate(schedule.programs):
            while len(times[s]) < len(prog):
                action = prog[len(times[s])]
                dep = _dependency(schedule, s, action)
                if dep is not None and dep not in finish:
                    break
                v = action.chunk * P + s
                arrive = 0 if dep is None else finish[dep] + links[v - 1 if action.kind == FORWARD else v]
                start = max(free[s], arrive)
                free[s] = start + (fwd[v] if action.kind == FORWARD else bwd[v])
                finish[(s, action)] = free[s]
                times[s].append((start, free[s]))
                progressed = True
    stuck = []
    for s, prog in enumerate(schedule.programs):
        if len(times[s]) < len(prog):
            action = prog[len(times[s])]
            dep = _dependency(schedule, s, action)
            assert dep is not None
            stuck.append(f"stage {s} waits at {action} for {dep[1]} from stage {dep[0]}")
    if stuck:
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))
    return times


def simulate(schedule: Schedule) -> list[list[Action | None]]:
    """Run the schedule in the unit-time model and return its time grid.

    Each tick (one time unit), every stage whose next action's dependency was
    completed in an earlier tick runs that action; other stages idle.

    Returns:
        One row per stage, one column per tick; ``None`` where the stage idles.
        All rows have the same length (the step's makespan in ticks).

    Raises:
        ScheduleError: if the programs are malformed (see ``validate``) or the
            schedule deadlocks (the message names each stage's stuck action).
    """
    times = timeline(schedule)
    ticks = max(finish for row in times for _, finish in row)
    grid: list[list[Action | None]] = [[None] * ticks for _ in times]
    for s, row in enumerate(times):
        for action, (start, _) in zip(schedule.programs[s], row):
            grid[s][start] = action
    return grid


def bubble_fraction(schedule: Schedule) -> float:
    """Idle slots / total slots (stages x ticks) of the unit-time ``simulate`` grid.

    For GPipe this is ``(P - 1) / (M + P - 1)``. Unitless, in ``[0, 1)``.

    Raises:
        ScheduleError: as ``validate``.
    """
    grid = simulate(schedule)
    total = sum(len(row) for row in grid)
    idle = sum(1 for row in grid for a in row if a is None)
    return idle / total


def format_grid(schedule: Schedule) -> str:
    """Printable ``simulate`` grid: one line per stage, ``.`` for idle ticks, aligned columns.

    Example line: ``stage 0 | F0 F1 .  B0 B1``.

    Raises:
        ScheduleError: as ``validate``.
    """
    grid = simulate(schedule)
    width = max((len(str(a)) for row in grid for a in row if a is not None), default=1)
    label = len(str(schedule.num_stages - 1))
    lines = []
    for s, row in enumerate(grid):
        cells = " ".join(("." if a is None else str(a)).ljust(width) for a in row)
        lines.append(f"stage {s:>{label}} | {cells}".rstrip())
    return "\n".join(lines)

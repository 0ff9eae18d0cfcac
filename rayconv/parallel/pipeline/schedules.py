"""Pipeline step programs as data: actions, the schedules that order them, and their structure checks.

A *schedule* assigns to every pipeline stage a *program*: the order in which that stage runs its
actions. An action is ``F<m>`` (forward of micro-batch ``m``) or ``B<m>`` (backward of micro-batch
``m``), with the model chunk it runs on under interleaving (``F3c1``). Programs are plain data so they
can be validated, simulated and printed before any Ray actor or GPU is involved (the same idea as
``torch.distributed.pipelining``'s ``_Action`` lists).

Schedules provided
------------------
* ``gpipe`` -- GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism", arXiv:1811.06965, section 2.2): every stage runs all forwards
  ``F0..F(M-1)``, then all backwards. Backwards run in order ``B0..B(M-1)``, as
  ``torch.distributed.pipelining.ScheduleGPipe`` does. Every stage holds the activations of all ``M``
  micro-batches.
* ``1f1b`` -- one-forward-one-backward, non-interleaved (PipeDream-Flush: Narayanan et al. 2021,
  "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021, section 3.1; also Narayanan et al.
  2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section
  2.2.1, ``forward_backward_pipelining_without_interleaving``). Stage ``s`` of ``P`` runs
  ``min(P - s - 1, M)`` warm-up forwards, then alternates one forward and one backward, then drains
  the remaining backwards. Stage ``s`` holds at most ``min(P - s, M)`` micro-batches' activations.
* interleaved 1F1B (``interleaved_1f1b``; ``make_schedule("1f1b", P, M, V)`` with ``V > 1``) --
  Narayanan et al. 2021 (Megatron-LM), section 2.2.2: each stage holds ``V`` model chunks (virtual
  stages ``s, s + P, ...``), which shrinks the bubble about ``V``-fold for ``V`` times the messages.
* ``forward_only`` -- evaluation: forwards only, micro-batch after micro-batch.

Also here: the structure check every other check starts with (one ``F`` and one ``B`` per micro-batch
and chunk, ``F`` before ``B``) and ``peak_in_flight``, which reads the activation memory off the
programs. When actions run is ``simulate.py``'s; what they send is ``p2p.py``'s.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable
from rayconv.errors import ScheduleError

__all__ = [
    "FORWARD", "BACKWARD", "Action", "Schedule", "ScheduleError", "SCHEDULE_NAMES", "gpipe", "one_f_one_b",
    "interleaved_1f1b", "forward_only", "make_schedule", "peak_in_flight",
]

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """One unit of work on one stage.

    Attributes:
        kind: ``"F"`` (forward) or ``"B"`` (backward).
        microbatch: micro-batch index, ``>= 0``.
        chunk: which of the stage's model chunks runs it (``0`` unless the schedule is interleaved;
            chunk ``c`` of stage ``s`` is virtual stage ``c * P + s``). Printed as ``F3c1``.

    Raises:
        ValueError: if ``kind`` is not ``"F"``/``"B"``, or ``microbatch`` or ``chunk`` is negative.
    """

    kind: str  # "F" or "B"
    microbatch: int
    chunk: int = 0  # the stage's model chunk (interleaved schedules; 0 otherwise)

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise ValueError(f"Action.kind must be 'F' or 'B', got {self.kind!r}")
        if self.microbatch < 0:
            raise ValueError(f"Action.microbatch must be >= 0, got {self.microbatch}")
        if self.chunk < 0:
            raise ValueError(f"Action.chunk must be >= 0, got {self.chunk}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """Per-stage action programs for one training step.

    Attributes:
        name: schedule name, e.g. ``"gpipe"`` or ``"1f1b"``.
        num_stages: number of pipeline stages ``P``.
        num_microbatches: number of micro-batches ``M`` per step.
        programs: one tuple of actions per stage (index = stage), in run order.
        virtual_stages: virtual stages (model chunks) per stage ``V`` (``P * V`` in all; 1 unless
            interleaved).
        training: False for a forward-only program (evaluation: ``forward_only``), which has no ``B``.

    Construction does not check consistency; call ``validate`` for that.
    """

    name: str
    num_stages: int
    num_microbatches: int
    programs: tuple[tuple[Action, ...], ...]
    virtual_stages: int = 1
    training: bool = True


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(
            f"num_stages must be an int >= 1 (got {num_stages!r}); "
            "use at least one pipeline stage"
        )
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"num_microbatches must be an int >= 1 (got {num_microbatches!r}); "
            "split each batch into at least one micro-batch"
        )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards ``F0..F(M-1)``, then all backwards ``B0..B(M-1)``, on every stage.

    Raises:
        ValueError: if ``num_stages < 1`` or ``num_microbatches < 1``.
    """
    _check_sizes(num_stages, num_microbatches)
    fwd = tuple(Action(FORWARD, m) for m in range(num_microbatches))
    bwd = tuple(Action(BACKWARD, m) for m in range(num_microbatches))
    return Schedule("gpipe", num_stages, num_microbatches, tuple(fwd + bwd for _ in range(num_stages)))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-Flush / Megatron without interleaving).

    Stage ``s`` runs ``w = min(P - s - 1, M)`` warm-up forwards, then ``M - w`` pairs
    of (next forward, oldest backward), then the ``w`` remaining backwards.

    Raises:
        ValueError: if ``num_stages < 1`` or ``num_microbatches < 1``.
    """
    _check_sizes(num_stages, num_microbatches)
    programs: list[tuple[Action, ...]] = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        remaining = num_microbatches - warmup
        prog = [Action(FORWARD, m) for m in range(warmup)]
        next_f, next_b = warmup, 0
        for _ in range(remaining):
            prog.append(Action(FORWARD, next_f))
            prog.append(Action(BACKWARD, next_b))
            next_f += 1
            next_b += 1
        prog.extend(Action(BACKWARD, m) for m in range(next_b, num_microbatches))
        programs.append(tuple(prog))
    return Schedule("1f1b", num_stages, num_microbatches, tuple(programs))


def interleaved_chunk(k: int, P: int, V: int, forward: bool) -> int:
    """Interleaved 1F1B: the model chunk of a stage's k-th forward (or backward). Micro-batches pass
    each chunk in groups of P; backwards visit the chunks in reverse (Megatron-LM's
    ``get_model_chunk_id``)."""
    c = (k % (P * V)) // P
    return c if forward else V - 1 - c


def interleaved_warmup(P: int, M: int, V: int, stage: int) -> int:
    """Interleaved 1F1B: forwards ``stage`` runs before its first backward (all of them when M == P)."""
    return M * V if M == P else min(M * V, (P - stage - 1) * 2 + (V - 1) * P)


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", section 2.2.2; Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``): each of the ``P`` stages holds ``V`` model
    chunks, chunk ``c`` of stage ``s`` being virtual stage ``c * P + s`` of ``P * V``. Micro-batches go
    through the chunks in groups of ``P``: stage ``s`` runs ``(P - s - 1) * 2 + (V - 1) * P`` warm-up
    forwards (all of them when ``M == P``), then alternates one forward and one backward, then drains.
    The bubble shrinks by ``V`` against ``one_f_one_b`` (about ``(P - 1) / (V * M)`` of the step), for
    ``V`` times as many point-to-point messages.

    Raises:
        ValueError: if ``num_stages < 2``, ``num_microbatches < 1``, ``virtual_stages < 2``, or
            ``num_microbatches`` is not a multiple of ``num_stages`` (micro-batches enter in groups of P).
    """
    _check_sizes(num_stages, num_microbatches)
    P, M, V = num_stages, num_microbatches, virtual_stages
    if P < 2:
        raise ValueError(f"interleaved 1F1B needs at least 2 pipeline stages (got --pp {P})")
    if not isinstance(V, int) or V < 2:
        raise ValueError(f"interleaved 1F1B needs at least 2 model chunks per stage (got {V!r}); "
                         "with 1 use the 1f1b schedule")
    if M % P:
        raise ValueError(f"interleaved 1F1B takes micro-batches in groups of the stage count: "
                         f"--num-microbatches {M} is not a multiple of --pp {P}")
    total = M * V

    def action(kind: str, k: int) -> Action:
        return Action(kind, (k // (P * V)) * P + k % P, interleaved_chunk(k, P, V, kind == FORWARD))

    programs: list[tuple[Action, ...]] = []
    for s in range(P):
        warmup = interleaved_warmup(P, M, V, s)
        prog = [action(FORWARD, k) for k in range(warmup)]
        for k in range(total - warmup):
            prog.append(action(FORWARD, warmup + k))
            prog.append(action(BACKWARD, k))
        prog.extend(action(BACKWARD, k) for k in range(total - warmup, total))
        programs.append(tuple(prog))
    return Schedule("interleaved", P, M, tuple(programs), virtual_stages=V)


def forward_only(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Evaluation: every stage runs ``F(m)`` of each of its chunks in turn, micro-batch after
    micro-batch (``F0c0 F0c1 F1c0 ...``); no backward.

    Raises:
        ValueError: if a size is below 1.
    """
    _check_sizes(num_stages, num_microbatches)
    prog = tuple(Action(FORWARD, m, c) for m in range(num_microbatches) for c in range(virtual_stages))
    return Schedule("forward", num_stages, num_microbatches, (prog,) * num_stages,
                    virtual_stages=virtual_stages, training=False)


_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def make_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name (one of ``SCHEDULE_NAMES``: ``"gpipe"``, ``"1f1b"``). With
    ``virtual_stages`` V > 1 (model chunks per stage) ``"1f1b"`` is ``interleaved_1f1b``.

    Raises:
        ValueError: for an unknown ``name``, ``num_stages < 1``, ``num_microbatches < 1``, chunks with
            ``"gpipe"``, or what ``interleaved_1f1b`` raises.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; allowed names: {', '.join(SCHEDULE_NAMES)}")
    if virtual_stages != 1:
        if name != "1f1b":
            raise ValueError(
                f"model chunks per stage (got {virtual_stages}) need the 1f1b schedule (interleaved), "
                f"not {name}")
        return interleaved_1f1b(num_stages, num_microbatches, virtual_stages)
    return _BUILDERS[name](num_stages, num_microbatches)


def check_programs(schedule: Schedule) -> None:
    """Structural checks: stage count, exactly one F and one B per micro-batch, F before B."""
    P, M = schedule.num_stages, schedule.num_microbatches
    if P < 1 or M < 1:
        raise ScheduleError(f"num_stages ({P}) and num_microbatches ({M}) must be >= 1")
    if len(schedule.programs) != P:
        raise ScheduleError(f"schedule has {len(schedule.programs)} programs but num_stages={P}")
    V = schedule.virtual_stages
    kinds = (FORWARD, BACKWARD) if schedule.training else (FORWARD,)
    expected = {Action(k, m, c) for k in kinds for m in range(M) for c in range(V)}
    for s, prog in enumerate(schedule.programs):
        counts = Counter(prog)
        missing = sorted(map(str, expected - counts.keys()))
        extra = sorted(str(a) for a in counts if a not in expected)
        dups = sorted(str(a) for a, c in counts.items() if c > 1 and a in expected)
        problems = []
        if missing:
            problems.append(f"missing {' '.join(missing)}")
        if extra:
            problems.append(f"unexpected {' '.join(extra)} (micro-batches are 0..{M - 1})")
        if dups:
            problems.append(f"duplicated {' '.join(dups)}")
        if problems:
            raise ScheduleError(
                f"stage {s}: program must hold exactly one F{' and one B' if schedule.training else ''} per "
                "micro-batch "
                f"0..{M - 1}{f' and chunk 0..{V - 1}' if V > 1 else ''}: {'; '.join(problems)}"
            )
        seen_f: set[tuple[int, int]] = set()
        for a in prog:
            if a.kind == FORWARD:
                seen_f.add((a.microbatch, a.chunk))
            elif (a.microbatch, a.chunk) not in seen_f:
                raise ScheduleError(f"stage {s}: {a} comes before {Action(FORWARD, a.microbatch, a.chunk)}")


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose F has run and whose B has not.

    This is the peak number of micro-batches' activations a stage holds (in
    micro-batches). For ``1f1b`` it is ``min(P - s, M)``; for ``gpipe`` it is ``M``.

    Raises:
        ScheduleError: if the programs are malformed (see ``validate``).
    """
    check_programs(schedule)
    peaks: list[int] = []
    for prog in schedule.programs:
        live = peak = 0
        for a in prog:
            live += 1 if a.kind == FORWARD else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks

"""Pipeline step programs as data: which stage runs which forward/backward, in what order.

A *schedule* assigns to every pipeline stage a *program*: the order in which that
stage runs its actions. An action is ``F<m>`` (forward of micro-batch ``m``) or
``B<m>`` (backward of micro-batch ``m``). Programs are plain data so they can be
validated, simulated and printed before any Ray actor or GPU is involved (the
same idea as ``torch.distributed.pipelining``'s ``_Action`` lists).

Schedules provided
------------------
* ``gpipe`` -- GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant
  Neural Networks using Pipeline Parallelism", arXiv:1811.06965, section 2.2):
  every stage runs all forwards ``F0..F(M-1)``, then all backwards. Backwards run
  in order ``B0..B(M-1)``, as ``torch.distributed.pipelining.ScheduleGPipe``
  does. Every stage holds the activations of all ``M`` micro-batches.
* ``1f1b`` -- one-forward-one-backward, non-interleaved (PipeDream-Flush:
  Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training",
  ICML 2021, section 3.1; also Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.1,
  ``forward_backward_pipelining_without_interleaving``). Stage ``s`` of ``P``
  runs ``min(P - s - 1, M)`` warm-up forwards, then alternates one forward and
  one backward, then drains the remaining backwards. Stage ``s`` holds at most
  ``min(P - s, M)`` micro-batches' activations.
* interleaved 1F1B (``interleaved_1f1b``; ``make_schedule("1f1b", P, M, V)`` with ``V > 1``) --
  Narayanan et al. 2021 (Megatron-LM), section 2.2.2: each stage holds ``V`` model chunks (virtual
  stages ``s, s + P, ...``), which shrinks the bubble about ``V``-fold for ``V`` times the messages.
  Actions name their chunk (``F3c1``).

Communication model (used by ``validate``/``simulate``)
-------------------------------------------------------
* ``F(m)`` on stage ``s > 0`` blocks until stage ``s - 1`` has completed ``F(m)``
  (it receives that activation); with chunks, until the previous *virtual* stage has.
* ``B(m)`` on stage ``s < P - 1`` blocks until stage ``s + 1`` has completed
  ``B(m)`` (it receives that gradient); with chunks, the next virtual stage.
* Sends are non-blocking (buffered), so they never wait.
* Every action takes one time tick (the ideal unit-time model, F = B = 1).

Exchange model (used by ``check_exchanges``, and by ``validate``)
----------------------------------------------------------------
The unit-time model above lets sends buffer. NCCL does not, once a message is large: a send
completes only when the peer's matching receive runs, messages between two ranks match in the
order they were posted, and each rank's operations on the pipeline's communicator run one batch
after another on one stream. And a batch (one ``ncclGroupStart``/``End`` group) goes through as a
unit: none of its operations runs before the peers have posted the counterparts of all of them
(a group's connections to a new peer are set up on the host before it starts; its send and receive
with one peer run fused). So neighbours' batches must mirror each other: a stage whose batch holds
"send activation, receive gradient" waits forever on a peer that must use that activation before
it can send the gradient. ``check_exchanges`` replays the batches ``StageRunner.run`` posts
(``exchange_plan``) under exactly those rules, with no buffering, and raises on a deadlock or on a
receive that would match another micro-batch's message.

Legend for ``format_grid``: ``F3`` = forward of micro-batch 3, ``B3`` = backward
of micro-batch 3, ``.`` = stage idle for that tick.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = [
    "Action", "Schedule", "ScheduleError", "SCHEDULE_NAMES", "gpipe", "one_f_one_b", "interleaved_1f1b",
    "forward_only", "make_schedule", "validate", "simulate", "Post", "exchange_plan", "check_exchanges",
    "bubble_fraction", "peak_in_flight", "format_grid",
]

FORWARD = "F"
BACKWARD = "B"


class ScheduleError(ValueError):
    """A schedule is malformed (missing/duplicate/misordered actions) or deadlocks."""


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
        num_chunks: model chunks per stage ``V`` (virtual stages ``P * V``; 1 unless interleaved).
        training: False for a forward-only program (evaluation: ``forward_only``), which has no ``B``.

    Construction does not check consistency; call ``validate`` for that.
    """

    name: str
    num_stages: int
    num_microbatches: int
    programs: tuple[tuple[Action, ...], ...]
    num_chunks: int = 1
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


def _interleaved_chunk(k: int, P: int, V: int, forward: bool) -> int:
    """Interleaved 1F1B: the model chunk of a stage's k-th forward (or backward). Micro-batches pass
    each chunk in groups of P; backwards visit the chunks in reverse (Megatron-LM's ``get_model_chunk_id``)."""
    c = (k % (P * V)) // P
    return c if forward else V - 1 - c


def _interleaved_warmup(P: int, M: int, V: int, stage: int) -> int:
    """Interleaved 1F1B: forwards ``stage`` runs before its first backward (all of them when M == P)."""
    return M * V if M == P else min(M * V, (P - stage - 1) * 2 + (V - 1) * P)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", section 2.2.2; Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``): each of the ``P`` stages holds ``V`` model
    chunks, chunk ``c`` of stage ``s`` being virtual stage ``c * P + s`` of ``P * V``. Micro-batches go
    through the chunks in groups of ``P``: stage ``s`` runs ``(P - s - 1) * 2 + (V - 1) * P`` warm-up
    forwards (all of them when ``M == P``), then alternates one forward and one backward, then drains.
    The bubble shrinks by ``V`` against ``one_f_one_b`` (about ``(P - 1) / (V * M)`` of the step), for
    ``V`` times as many point-to-point messages.

    Raises:
        ValueError: if ``num_stages < 2``, ``num_microbatches < 1``, ``num_chunks < 2``, or
            ``num_microbatches`` is not a multiple of ``num_stages`` (micro-batches enter in groups of P).
    """
    _check_sizes(num_stages, num_microbatches)
    P, M, V = num_stages, num_microbatches, num_chunks
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
        return Action(kind, (k // (P * V)) * P + k % P, _interleaved_chunk(k, P, V, kind == FORWARD))

    programs: list[tuple[Action, ...]] = []
    for s in range(P):
        warmup = _interleaved_warmup(P, M, V, s)
        prog = [action(FORWARD, k) for k in range(warmup)]
        for k in range(total - warmup):
            prog.append(action(FORWARD, warmup + k))
            prog.append(action(BACKWARD, k))
        prog.extend(action(BACKWARD, k) for k in range(total - warmup, total))
        programs.append(tuple(prog))
    return Schedule("interleaved", P, M, tuple(programs), num_chunks=V)


def forward_only(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Evaluation: every stage runs ``F(m)`` of each of its chunks in turn, micro-batch after
    micro-batch (``F0c0 F0c1 F1c0 ...``); no backward.

    Raises:
        ValueError: if a size is below 1.
    """
    _check_sizes(num_stages, num_microbatches)
    prog = tuple(Action(FORWARD, m, c) for m in range(num_microbatches) for c in range(num_chunks))
    return Schedule("forward", num_stages, num_microbatches, (prog,) * num_stages, num_chunks=num_chunks,
                    training=False)


_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def make_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Build a schedule by name (one of ``SCHEDULE_NAMES``: ``"gpipe"``, ``"1f1b"``). With
    ``num_chunks`` V > 1 (model chunks per stage) ``"1f1b"`` is ``interleaved_1f1b``.

    Raises:
        ValueError: for an unknown ``name``, ``num_stages < 1``, ``num_microbatches < 1``, chunks with
            ``"gpipe"``, or what ``interleaved_1f1b`` raises.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; allowed names: {', '.join(SCHEDULE_NAMES)}")
    if num_chunks != 1:
        if name != "1f1b":
            raise ValueError(f"model chunks per stage (got {num_chunks}) need the 1f1b schedule (interleaved), "
                             f"not {name}")
        return interleaved_1f1b(num_stages, num_microbatches, num_chunks)
    return _BUILDERS[name](num_stages, num_microbatches)


def _check_programs(schedule: Schedule) -> None:
    """Structural checks: stage count, exactly one F and one B per micro-batch, F before B."""
    P, M = schedule.num_stages, schedule.num_microbatches
    if P < 1 or M < 1:
        raise ScheduleError(f"num_stages ({P}) and num_microbatches ({M}) must be >= 1")
    if len(schedule.programs) != P:
        raise ScheduleError(f"schedule has {len(schedule.programs)} programs but num_stages={P}")
    V = schedule.num_chunks
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


def _dependency(schedule: Schedule, stage: int, action: Action) -> tuple[int, Action] | None:
    """The (stage, action) that must complete before ``action`` can run on ``stage``, if any: the
    same action of the previous virtual stage (forward) or the next one (backward)."""
    P = schedule.num_stages
    v = action.chunk * P + stage
    if action.kind == FORWARD and v > 0:
        return (v - 1) % P, Action(FORWARD, action.microbatch, (v - 1) // P)
    if action.kind == BACKWARD and v < P * schedule.num_chunks - 1:
        return (v + 1) % P, Action(BACKWARD, action.microbatch, (v + 1) // P)
    return None


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
    _check_programs(schedule)
    P = schedule.num_stages
    done: set[tuple[int, Action]] = set()  # completed before the current tick
    pc = [0] * P  # index of each stage's next action
    grid: list[list[Action | None]] = [[] for _ in range(P)]
    while any(pc[s] < len(schedule.programs[s]) for s in range(P)):
        ran: list[tuple[int, Action]] = []
        for s in range(P):
            prog = schedule.programs[s]
            if pc[s] < len(prog):
                action = prog[pc[s]]
                dep = _dependency(schedule, s, action)
                if dep is None or dep in done:
                    ran.append((s, action))
                    grid[s].append(action)
                    pc[s] += 1
                    continue
            grid[s].append(None)
        if not ran:
            stuck = []
            for s in range(P):
                if pc[s] < len(schedule.programs[s]):
                    action = schedule.programs[s][pc[s]]
                    dep = _dependency(schedule, s, action)
                    assert dep is not None
                    stuck.append(f"stage {s} waits at {action} for {dep[1]} from stage {dep[0]}")
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))
        done.update(ran)
    return grid


def _messages(schedule: Schedule, stage: int, action: Action) -> tuple[Optional[tuple], Optional[tuple]]:
    """What ``action`` on ``stage`` receives before it runs and sends after it, each as
    ``(kind, microbatch, source stage, destination stage, source virtual stage)`` or None. Kinds:
    ``"act"`` (a forward's output, sent to the next virtual stage), ``"grad"`` (a backward's input
    gradient, sent to the previous)."""
    P = schedule.num_stages
    last = P * schedule.num_chunks - 1
    m, v = action.microbatch, action.chunk * P + stage
    if action.kind == FORWARD:
        recv = ("act", m, (v - 1) % P, stage, v - 1) if v > 0 else None
        send = ("act", m, stage, (v + 1) % P, v) if v < last else None
    else:
        recv = ("grad", m, (v + 1) % P, stage, v + 1) if v < last else None
        send = ("grad", m, stage, (v - 1) % P, v) if v > 0 else None
    return recv, send


@dataclass(frozen=True)
class Post:
    """One batch of point-to-point operations a stage posts before one action computes: the outputs
    of earlier actions (``sends``: their indices in the stage's program) and the inputs of this or
    later actions (``recvs``), all in one ``ncclGroupStart``/``End`` group."""

    sends: tuple[int, ...]
    recvs: tuple[int, ...]


def exchange_plan(schedule: Schedule, stage: int) -> list[tuple[Post, ...]]:
    """The batches ``StageRunner.run`` posts on ``stage``: ``plan[i]`` (zero or more batches, none
    empty, posted in order) just before action ``i`` computes, and ``plan[len(program)]`` after the last (the sends
    left over).

    Rounds: without model chunks (and for ``forward_only``), each action's output is sent with the
    next action's input, so no send waits behind another action and 1F1B's crossing messages share
    a batch. Interleaved 1F1B exchanges as Megatron-LM's ``forward_backward_pipelining_with_interleaving``
    does: once after each warm-up forward, after each steady-state forward-backward pair ("send
    forward, send backward, receive forward, receive backward" in one batch) and after each
    cool-down backward; a received tensor goes to the next action of its model chunk that needs one.

    Mirroring: NCCL runs a group's operations as one unit (see ``check_exchanges``), so two stages'
    batches must pair up: the k-th batch of stage a that talks to stage b holds exactly the
    counterparts of the k-th batch of b that talks to a. A round batch that does not (GPipe's "send
    the last activation, receive the first gradient", whose peer must use that activation before it
    can send the gradient) is split, the operations its peer's batch matches first.
    """
    return [tuple(posts) for posts in _plans(schedule)[stage]]


@functools.lru_cache(maxsize=32)
def _plans(schedule: Schedule) -> tuple[tuple[tuple[Post, ...], ...], ...]:
    """Every stage's ``exchange_plan``: its ``_round_plan``, batches split until neighbours' batches
    mirror; then, while ``check_exchanges``'s model still deadlocks, each stuck batch that talks to
    several stages split into one batch per stage (sends first) and mirrored again. What cannot be
    mended so (messages in another order, a deadlock of single-peer batches) is left for
    ``check_exchanges`` to name."""
    P = schedule.num_stages
    msgs = [[_messages(schedule, s, a) for a in prog] for s, prog in enumerate(schedule.programs)]
    plans = [[[p] if p.sends or p.recvs else [] for p in _round_plan(schedule, s)] for s in range(P)]

    def peer(s: int, msg: tuple) -> int:
        return msg[3] if msg[2] == s else msg[2]

    def ops(s: int, post: Post) -> list[tuple[str, int, tuple]]:
        return [("send", j, msgs[s][j][1]) for j in post.sends] + [("recv", j, msgs[s][j][0]) for j in post.recvs]

    def make(part: list[tuple[str, int, tuple]]) -> Post:
        return Post(tuple(j for kind, j, _ in part if kind == "send"), tuple(j for kind, j, _ in part if kind == "recv"))

    def projection(s: int, q: int) -> list[tuple[int, int, frozenset]]:
        return [(i, b, x) for i, posts in enumerate(plans[s]) for b, post in enumerate(posts)
                if (x := frozenset(m for _, _, m in ops(s, post) if peer(s, m) == q))]

    def split(s: int, i: int, b: int, q: int, first: frozenset) -> None:
        """Batch b before action i of stage s in two: its operations with q in ``first`` (and those
        with other stages), then its other operations with q."""
        o = ops(s, plans[s][i][b])
        head = [op for op in o if peer(s, op[2]) != q or op[2] in first]
        plans[s][i][b:b + 1] = [make(head), make([op for op in o if op not in head])]

    pairs = sorted({tuple(sorted((s, peer(s, m)))) for s in range(P) for r, t in msgs[s] for m in (r, t) if m})

    def mirror() -> None:
        changed = True
        while changed:
            changed = False
            for a, q in pairs:
                for (ia, ba, x), (iq, bq, y) in zip(projection(a, q), projection(q, a)):
                    if x == y:
                        continue
                    common = x & y
                    if common:  # else messages in another order: check_exchanges names it
                        if x - common:
                            split(a, ia, ba, q, common)
                        if y - common:
                            split(q, iq, bq, a, common)
                        changed = True
                    break
                if changed:
                    break

    def frozen() -> tuple[tuple[tuple[Post, ...], ...], ...]:
        return tuple(tuple(tuple(posts) for posts in plan) for plan in plans)

    mirror()
    while True:
        events = _events(schedule, frozen())
        try:
            stuck = _replay(events, _counterparts(schedule, events))
        except ScheduleError:
            break
        mended = False
        for s, j in stuck:
            _, _, i, b = events[s][j]
            o = ops(s, plans[s][i][b])
            peers = sorted({peer(s, m) for _, _, m in o},
                           key=lambda q: min(0 if kind == "send" else 1 for kind, _, m in o if peer(s, m) == q))
            if len(peers) > 1:
                plans[s][i][b:b + 1] = [make([op for op in o if peer(s, op[2]) == q]) for q in peers]
                mended = True
        if not mended:
            break
        mirror()
    return frozen()


def _round_plan(schedule: Schedule, stage: int) -> list[Post]:
    """The rounds of ``exchange_plan`` before mirroring: one batch (maybe empty) per action and one after."""
    prog = schedule.programs[stage]
    msgs = [_messages(schedule, stage, a) for a in prog]
    if schedule.num_chunks == 1 or not schedule.training:
        return [Post((i - 1,) if i > 0 and msgs[i - 1][1] is not None else (),
                     (i,) if i < len(prog) and msgs[i][0] is not None else ()) for i in range(len(prog) + 1)]
    P, M, V = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    total = M * V
    first, last = stage == 0, stage == P - 1

    def chunk(k: int, forward: bool) -> int:
        return _interleaved_chunk(k, P, V, forward)

    # The actions of each chunk that receive their input, in program order (consumed first in, first out).
    queue = {(kind, c): [i for i, a in enumerate(prog) if a.kind == kind and a.chunk == c and msgs[i][0]]
             for kind in (FORWARD, BACKWARD) for c in range(V)}

    def take(kind: str, c: int) -> tuple[int, ...]:
        return (queue[(kind, c)].pop(0),)

    sends: list[list[int]] = [[] for _ in range(len(prog) + 1)]
    recvs: list[list[int]] = [[] for _ in range(len(prog) + 1)]
    all_warmup = M == P
    warmup = _interleaved_warmup(P, M, V, stage)
    remaining = total - warmup

    def out(i: int) -> list[int]:
        return [i] if msgs[i][1] is not None else []

    if not first:
        recvs[0] += take(FORWARD, 0)
    for k in range(warmup):  # after warm-up forward k (program index k)
        at = k + 1
        sends[at] += out(k)
        if k + 1 < total and not (first and chunk(k + 1, True) == 0):
            recvs[at] += take(FORWARD, chunk(k + 1, True))
        if k == warmup - 1 and not all_warmup and not last:
            recvs[at] += take(BACKWARD, V - 1)
    for k in range(remaining):  # after steady pair k: forward warmup + k, backward k
        f_i, b_i = warmup + 2 * k, warmup + 2 * k + 1
        at = b_i + 1
        sends[at] += out(f_i) + out(b_i)
        fk = warmup + k
        recv_prev = k < remaining - 1
        if first:
            nfc = chunk(fk - (P - 1), True)
            recv_prev = recv_prev and nfc != V - 1
            nfc += 1
        else:
            nfc = chunk(fk + 1, True)
        recv_next = True
        if last:
            nbc = chunk(k - (P - 1), False)
            recv_next = nbc != 0
            nbc -= 1
        else:
            nbc = chunk(k + 1, False)
        if recv_prev:
            recvs[at] += take(FORWARD, nfc)
        if recv_next:
            recvs[at] += take(BACKWARD, nbc)
    cool0 = warmup + 2 * remaining
    if all_warmup and not last:
        recvs[cool0] += take(BACKWARD, V - 1)
    for k in range(remaining, total):  # after cool-down backward k
        i = cool0 + (k - remaining)
        sends[i + 1] += out(i)
        nbc = chunk(k + 1, False)
        if k < total - 1 and not (last and nbc == V - 1):
            recvs[i + 1] += take(BACKWARD, nbc)
    left = [i for q in queue.values() for i in q]
    if left:
        raise ScheduleError(f"schedule {schedule.name!r}: stage {stage} never receives the input of "
                            f"{', '.join(str(prog[i]) for i in sorted(left))}")
    return [Post(tuple(sends[i]), tuple(recvs[i])) for i in range(len(prog) + 1)]


def check_exchanges(schedule: Schedule, paired: bool = True) -> None:
    """Replay the point-to-point batches a step posts under NCCL's rules (see "Exchange model").

    With ``paired`` the batches are ``exchange_plan``'s, what ``StageRunner.run`` posts. With
    ``paired=False``, the pattern the pipeline used before session 5: each receive and each send is a
    batch of its own, the send posted right after its action computes.

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
    _check_programs(schedule)
    events = _events(schedule, _plans(schedule) if paired else None)
    stuck = _replay(events, _counterparts(schedule, events))
    if stuck:
        def waits(s: int, j: int) -> str:
            return ", ".join(f"{op[0]} {op[1][0]}{op[1][1]} {'to' if op[0] == 'send' else 'from'} stage "
                             f"{op[1][3] if op[0] == 'send' else op[1][2]}" for op in events[s][j][1] if not op[2])
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks when sends are not buffered "
                            f"({'paired' if paired else 'unpaired'} exchanges): "
                            + "; ".join(f"stage {s} waits on [{waits(s, j)}]" for s, j in stuck))


def _events(schedule: Schedule, plans: Optional[tuple]) -> list[list[tuple]]:
    """Per stage, its events in host order: ``("batch", [ops], posts index, batch index)`` and
    ``("compute", action index)``. An op is ``[kind, message, matched]``, kind "send" or "recv". With
    ``plans`` None: every operation alone, each send right after its action (the unpaired pattern)."""
    events: list[list[tuple]] = []
    for s, prog in enumerate(schedule.programs):
        msgs = [_messages(schedule, s, a) for a in prog]
        ev: list[tuple] = []
        if plans is not None:
            for i, posts in enumerate(plans[s]):
                for b, post in enumerate(posts):
                    ops = [["send", msgs[j][1], False] for j in post.sends] + \
                          [["recv", msgs[j][0], False] for j in post.recvs]
                    if ops:
                        ev.append(("batch", ops, i, b))
                if i < len(prog):
                    ev.append(("compute", i))
        else:
            for i, (recv, send) in enumerate(msgs):
                if recv:
                    ev.append(("batch", [["recv", recv, False]], i, 0))
                ev.append(("compute", i))
                if send:
                    ev.append(("batch", [["send", send, False]], i + 1, 0))
        events.append(ev)
    return events


def _counterparts(schedule: Schedule, events: list[list[tuple]]) -> dict[int, list]:
    """``id(op) -> the op it matches``: the k-th send from a to b with the k-th receive b posts from a.
    Raises ScheduleError when those are different messages, or their counts differ."""
    sent: dict[tuple[int, int], list] = {}
    recvd: dict[tuple[int, int], list] = {}
    for ev in events:
        for e in ev:
            if e[0] == "batch":
                for op in e[1]:
                    key = (op[1][2], op[1][3])
                    (sent if op[0] == "send" else recvd).setdefault(key, []).append(op)
    for key in sorted(set(sent) | set(recvd)):
        out, inn = sent.get(key, []), recvd.get(key, [])
        for k, (a, b) in enumerate(zip(out, inn)):
            if a[1] != b[1]:
                def what(msg: tuple) -> str:
                    return f"{msg[0]} of micro-batch {msg[1]}" + (
                        f" (virtual stage {msg[4]})" if schedule.num_chunks > 1 else "")
                raise ScheduleError(
                    f"schedule {schedule.name!r}: message {k} from stage {key[0]} to stage {key[1]} is "
                    f"{what(a[1])} but stage {key[1]} expects {what(b[1])}: messages between two stages "
                    "arrive in the order they were sent")
        if len(out) != len(inn):
            raise ScheduleError(f"schedule {schedule.name!r}: stage {key[0]} sends {len(out)} messages to stage "
                                f"{key[1]}, which receives {len(inn)}")
    peer = {}
    for key in sent:
        for a, b in zip(sent[key], recvd[key]):
            peer[id(a)], peer[id(b)] = b, a
    return peer


def _replay(events: list[list[tuple]], peer: dict[int, list]) -> list[tuple[int, int]]:
    """Run ``events`` under ``check_exchanges``'s model (marking matched ops). Returns, for each stage
    that cannot finish, ``(stage, event index of its first batch not completed)``; empty if all finish."""
    P = len(events)
    where = {id(op): (s, j) for s, ev in enumerate(events) for j, e in enumerate(ev) if e[0] == "batch"
             for op in e[1]}  # id(op) -> (stage, event index of its batch)
    n_events = [len(ev) for ev in events]
    batches = [[j for j, e in enumerate(ev) if e[0] == "batch"] for ev in events]
    started: list[set[int]] = [set() for _ in range(P)]   # indices of started batches
    done: list[set[int]] = [set() for _ in range(P)]      # indices of completed batches
    active: set[int] = set()     # ids of ops whose batch has started
    pos = [0] * P                # the host's next event per stage; computes before it have run

    def armed(s: int, j: int) -> bool:
        return j in started[s] and all(id(peer[id(op)]) in active for op in events[s][j][1])

    progress = True
    while progress:
        progress = False
        for s in range(P):
            ev = events[s]
            # The host posts batches without waiting; a compute runs once every batch before it that
            # holds a receive has completed.
            while pos[s] < n_events[s]:
                e = ev[pos[s]]
                if e[0] == "compute" and any(j not in done[s] and any(op[0] == "recv" for op in ev[j][1])
                                             for j in batches[s] if j < pos[s]):
                    break
                pos[s] += 1
                progress = True
            # The communication stream: the first posted batch not yet started starts once its
            # predecessor has completed (computes before it have run: the host is past them).
            for k, j in enumerate(batches[s]):
                if j >= pos[s]:
                    break
                if j not in started[s] and (k == 0 or batches[s][k - 1] in done[s]):
                    started[s].add(j)
                    active.update(id(op) for op in ev[j][1])
                    progress = True
            for j in sorted(started[s] - done[s]):
                # A group goes through as one unit: its operations match once it and the batch of
                # each operation's counterpart are armed.
                if not armed(s, j):
                    continue
                for op in ev[j][1]:
                    if not op[2] and armed(*where[id(peer[id(op)])]):
                        op[2] = peer[id(op)][2] = True
                        progress = True
                if all(op[2] for op in ev[j][1]):
                    done[s].add(j)
                    progress = True
    stuck = []
    for s in range(P):
        left = [j for j in batches[s] if j not in done[s]]
        if pos[s] < n_events[s] or left:
            stuck.append((s, left[0]))
    return stuck


def validate(schedule: Schedule) -> None:
    """Check a schedule; return ``None`` if it is runnable.

    Raises:
        ScheduleError: if the number of programs differs from ``num_stages``; a
            stage's program does not contain exactly one ``F(m)`` and one ``B(m)``
            for each micro-batch ``0..M-1``; a ``B(m)`` precedes ``F(m)`` on a stage;
            the schedule deadlocks under the blocking-receive model; or its exchanges,
            as the pipeline posts them, deadlock or mismatch messages under NCCL's rules
            (``check_exchanges``).
    """
    simulate(schedule)
    check_exchanges(schedule)


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


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose F has run and whose B has not.

    This is the peak number of micro-batches' activations a stage holds (in
    micro-batches). For ``1f1b`` it is ``min(P - s, M)``; for ``gpipe`` it is ``M``.

    Raises:
        ScheduleError: if the programs are malformed (see ``validate``).
    """
    _check_programs(schedule)
    peaks: list[int] = []
    for prog in schedule.programs:
        live = peak = 0
        for a in prog:
            live += 1 if a.kind == FORWARD else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


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

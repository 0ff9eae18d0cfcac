"""What each pipeline stage sends and receives, batch by batch, and the check that it completes under NCCL.

``exchange_plan`` gives the batches of point-to-point operations ``StageRunner.run`` posts around each
action of a stage's program; ``check_exchanges`` replays them under the rules of ``nccl_model.py``.

Rounds: without model chunks each action's output goes out with the next action's input, so 1F1B's
crossing messages share a batch. Interleaved 1F1B exchanges as Megatron-LM's
``forward_backward_pipelining_with_interleaving`` does (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.2). Batches that do not
mirror their peer's are split until they do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rayconv.parallel.pipeline.nccl_model import _counterparts, _events, _messages, _replay
from rayconv.parallel.pipeline.schedules import BACKWARD, FORWARD, Schedule, _check_programs, _interleaved_chunk, _interleaved_warmup
from rayconv.errors import ScheduleError

__all__ = ["Post", "exchange_plan", "check_exchanges"]


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
    """Replay the point-to-point batches a step posts under NCCL's rules (``nccl_model.py``).

    With ``paired`` the batches are ``exchange_plan``'s, what ``StageRunner.run`` posts. With
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

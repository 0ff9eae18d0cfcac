"""What each pipeline stage sends and receives, batch by batch.

``p2p_posts`` gives the batches of point-to-point operations ``StageRunner.run`` posts around each
action of a stage's program; ``checks.check_exchanges`` replays them under the rules of ``nccl_model.py``.

Rounds: without model chunks each action's output goes out with the next action's input, so 1F1B's
crossing messages share a batch. Interleaved 1F1B exchanges as Megatron-LM's
``forward_backward_pipelining_with_interleaving`` does (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.2). Batches that do not
mirror their peer's are split until they do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rayconv.parallel.pipeline.nccl_model import counterparts, host_events, action_messages, replay
from rayconv.parallel.pipeline.schedules import (BACKWARD, FORWARD, Schedule, interleaved_chunk,
                                                 interleaved_warmup)
from rayconv.errors import ScheduleError

__all__ = ["Post", "p2p_posts"]


@dataclass(frozen=True)
class Post:
    """One batch of point-to-point operations a stage posts before one action computes: the outputs
    of earlier actions (``sends``: their indices in the stage's program) and the inputs of this or
    later actions (``recvs``), all in one ``ncclGroupStart``/``End`` group."""

    sends: tuple[int, ...]
    recvs: tuple[int, ...]


def p2p_posts(schedule: Schedule, stage: int) -> list[tuple[Post, ...]]:
    """The batches ``StageRunner.run`` posts on ``stage``: ``posts[i]`` (zero or more batches, none
    empty, posted in order) just before action ``i`` computes, and ``posts[len(program)]`` after the last (the
    sends left over).

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
    return [tuple(posts) for posts in stage_posts(schedule)[stage]]


@functools.lru_cache(maxsize=32)
def stage_posts(schedule: Schedule) -> tuple[tuple[tuple[Post, ...], ...], ...]:
    """Every stage's ``p2p_posts``: its ``_round_posts``, batches split until neighbours' batches
    mirror; then, while ``check_exchanges``'s model still deadlocks, each stuck batch that talks to
    several stages split into one batch per stage (sends first) and mirrored again. What cannot be
    mended so (messages in another order, a deadlock of single-peer batches) is left for
    ``check_exchanges`` to name."""
    by_stage = _StagePosts(schedule)
    by_stage.mirror()
    while True:
        events = host_events(schedule, by_stage.frozen())
        try:
            stuck = replay(events, counterparts(schedule, events))
        except ScheduleError:
            break
        if not by_stage.split_by_peer(events, stuck):
            break
        by_stage.mirror()
    return by_stage.frozen()


_Op = tuple[str, int, tuple]  # ("send" or "recv", index of the action in the stage's program, message)


class _StagePosts:
    """The stages' batches while ``stage_posts`` splits them: ``plans[s][i]`` is the list of batches stage
    ``s``
    posts before action ``i``, starting from ``_round_posts`` (an empty round is no batch)."""

    def __init__(self, schedule: Schedule):
        P = schedule.num_stages
        self.msgs = [[action_messages(schedule, s, a) for a in prog]
                     for s, prog in enumerate(schedule.programs)]
        self.by_stage = [[[p] if p.sends or p.recvs else [] for p in _round_posts(schedule, s)]
                         for s in range(P)]
        # Every pair of stages (lower first) that exchanges a message.
        self.pairs = sorted({tuple(sorted((s, self.peer(s, m))))
                             for s in range(P) for r, t in self.msgs[s] for m in (r, t) if m})

    @staticmethod
    def peer(s: int, msg: tuple) -> int:
        """The stage at the other end of ``msg`` from stage ``s``."""
        return msg[3] if msg[2] == s else msg[2]

    def ops(self, s: int, post: Post) -> list[_Op]:
        """The operations of batch ``post`` of stage ``s``: its sends, then its receives."""
        return ([("send", j, self.msgs[s][j][1]) for j in post.sends]
                + [("recv", j, self.msgs[s][j][0]) for j in post.recvs])

    @staticmethod
    def make(part: list[_Op]) -> Post:
        """The batch of operations ``part``."""
        return Post(tuple(j for kind, j, _ in part if kind == "send"),
                    tuple(j for kind, j, _ in part if kind == "recv"))

    def projection(self, s: int, q: int) -> list[tuple[int, int, frozenset]]:
        """Stage ``s``'s batches that talk to ``q``, in posting order: (action index, batch index, the
        messages with ``q``)."""
        return [(i, b, x) for i, posts in enumerate(self.by_stage[s]) for b, post in enumerate(posts)
                if (x := frozenset(m for _, _, m in self.ops(s, post) if self.peer(s, m) == q))]

    def split(self, s: int, i: int, b: int, q: int, first: frozenset) -> None:
        """Batch b before action i of stage s in two: its operations with q in ``first`` (and those
        with other stages), then its other operations with q."""
        o = self.ops(s, self.by_stage[s][i][b])
        head = [op for op in o if self.peer(s, op[2]) != q or op[2] in first]
        self.by_stage[s][i][b:b + 1] = [self.make(head), self.make([op for op in o if op not in head])]

    def mirror(self) -> None:
        """Split batches until, for every pair of stages, the k-th batch of each that talks to the other
        holds the same messages, or the first pair that differs shares none (another order)."""
        while self._mirror_once():
            pass

    def _mirror_once(self) -> bool:
        """Mend the first pair of batches that does not mirror; whether one was split."""
        for a, q in self.pairs:
            for (ia, ba, x), (iq, bq, y) in zip(self.projection(a, q), self.projection(q, a)):
                if x == y:
                    continue
                common = x & y
                if not common:  # messages in another order: check_exchanges names it
                    break
                if x - common:
                    self.split(a, ia, ba, q, common)
                if y - common:
                    self.split(q, iq, bq, a, common)
                return True
        return False

    def split_by_peer(self, events: list, stuck: list[tuple[int, int]]) -> bool:
        """Split each stuck batch that talks to several stages into one batch per stage, the stages it
        sends to first; whether any was split."""
        mended = False
        for s, j in stuck:
            _, _, i, b = events[s][j]
            o = self.ops(s, self.by_stage[s][i][b])
            peers = sorted({self.peer(s, m) for _, _, m in o}, key=lambda q: min(0 if kind == "send" else 1
                                                                                 for kind, _, m in o
                                                                                 if self.peer(s, m) == q))
            if len(peers) > 1:
                self.by_stage[s][i][b:b + 1] = [self.make([op for op in o if self.peer(s, op[2]) == q])
                                                for q in peers]
                mended = True
        return mended

    def frozen(self) -> tuple[tuple[tuple[Post, ...], ...], ...]:
        """The batches as nested tuples (what ``host_events`` reads and ``stage_posts`` returns)."""
        return tuple(tuple(tuple(posts) for posts in stage) for stage in self.by_stage)


def _round_posts(schedule: Schedule, stage: int) -> list[Post]:
    """The rounds of ``p2p_posts`` before mirroring: one batch (maybe empty) per action and one after."""
    prog = schedule.programs[stage]
    msgs = [action_messages(schedule, stage, a) for a in prog]
    if schedule.virtual_stages == 1 or not schedule.training:
        return [Post((i - 1,) if i > 0 and msgs[i - 1][1] is not None else (),
                     (i,) if i < len(prog) and msgs[i][0] is not None else ()) for i in range(len(prog) + 1)]
    return _InterleavedRounds(schedule, stage, msgs).posts()


class _InterleavedRounds:
    """Interleaved 1F1B's rounds on one stage, as Megatron-LM's
    ``forward_backward_pipelining_with_interleaving`` exchanges: after each warm-up forward, after each
    steady-state forward-backward pair, after each cool-down backward. ``sends[i]``/``recvs[i]`` collect
    the batch posted before action ``i``."""

    def __init__(self, schedule: Schedule, stage: int, msgs: list[tuple]):
        self.schedule, self.stage, self.msgs = schedule, stage, msgs
        self.prog = prog = schedule.programs[stage]
        P, M, V = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
        self.P, self.M, self.V = P, M, V
        self.total = M * V
        self.first, self.last = stage == 0, stage == P - 1
        # The actions of each chunk that receive their input, in program order (consumed first in, first out).
        self.queue = {
            (kind, c): [i for i, a in enumerate(prog) if a.kind == kind and a.chunk == c and msgs[i][0]]
            for kind in (FORWARD, BACKWARD)
            for c in range(V)
        }
        self.sends: list[list[int]] = [[] for _ in range(len(prog) + 1)]
        self.recvs: list[list[int]] = [[] for _ in range(len(prog) + 1)]
        self.all_warmup = M == P
        self.warmup = interleaved_warmup(P, M, V, stage)
        self.remaining = self.total - self.warmup

    def chunk(self, k: int, forward: bool) -> int:
        """The model chunk of the stage's k-th forward (or backward)."""
        return interleaved_chunk(k, self.P, self.V, forward)

    def take(self, kind: str, c: int) -> tuple[int, ...]:
        """The next action of chunk ``c`` of ``kind`` that receives its input."""
        return (self.queue[(kind, c)].pop(0),)

    def out(self, i: int) -> list[int]:
        """Action ``i`` if it sends its output, else nothing."""
        return [i] if self.msgs[i][1] is not None else []

    def posts(self) -> list[Post]:
        """The rounds, one batch (maybe empty) per action and one after.

        Raises:
            ScheduleError: if an action that needs an input is never given a receive."""
        if not self.first:
            self.recvs[0] += self.take(FORWARD, 0)
        self._warmup_rounds()
        self._steady_rounds()
        self._cooldown_rounds()
        left = [i for q in self.queue.values() for i in q]
        if left:
            raise ScheduleError(
                f"schedule {self.schedule.name!r}: stage {self.stage} never receives the input of "
                f"{', '.join(str(self.prog[i]) for i in sorted(left))}"
            )
        return [Post(tuple(self.sends[i]), tuple(self.recvs[i])) for i in range(len(self.prog) + 1)]

    def _warmup_rounds(self) -> None:
        for k in range(self.warmup):  # after warm-up forward k (program index k)
            at = k + 1
            self.sends[at] += self.out(k)
            if k + 1 < self.total and not (self.first and self.chunk(k + 1, True) == 0):
                self.recvs[at] += self.take(FORWARD, self.chunk(k + 1, True))
            if k == self.warmup - 1 and not self.all_warmup and not self.last:
                self.recvs[at] += self.take(BACKWARD, self.V - 1)

    def _steady_rounds(self) -> None:
        P, V, warmup, remaining = self.P, self.V, self.warmup, self.remaining
        for k in range(remaining):  # after steady pair k: forward warmup + k, backward k
            f_i, b_i = warmup + 2 * k, warmup + 2 * k + 1
            at = b_i + 1
            self.sends[at] += self.out(f_i) + self.out(b_i)
            fk = warmup + k
            recv_prev = k < remaining - 1
            if self.first:
                nfc = self.chunk(fk - (P - 1), True)
                recv_prev = recv_prev and nfc != V - 1
                nfc += 1
            else:
                nfc = self.chunk(fk + 1, True)
            recv_next = True
            if self.last:
                nbc = self.chunk(k - (P - 1), False)
                recv_next = nbc != 0
                nbc -= 1
            else:
                nbc = self.chunk(k + 1, False)
            if recv_prev:
                self.recvs[at] += self.take(FORWARD, nfc)
            if recv_next:
                self.recvs[at] += self.take(BACKWARD, nbc)

    def _cooldown_rounds(self) -> None:
        cool0 = self.warmup + 2 * self.remaining
        if self.all_warmup and not self.last:
            self.recvs[cool0] += self.take(BACKWARD, self.V - 1)
        for k in range(self.remaining, self.total):  # after cool-down backward k
            i = cool0 + (k - self.remaining)
            self.sends[i + 1] += self.out(i)
            nbc = self.chunk(k + 1, False)
            if k < self.total - 1 and not (self.last and nbc == self.V - 1):
                self.recvs[i + 1] += self.take(BACKWARD, nbc)

"""A replay model of NCCL's point-to-point rules: does a stage's exchange pattern complete without buffering?

The unit-time model of ``simulate.py`` lets sends buffer. NCCL does not, once a message is large: a
send completes only when the peer's matching receive runs, messages between two ranks match in the
order they were posted, and each rank's operations on the pipeline's communicator run one batch after
another on one stream. And a batch (one ``ncclGroupStart``/``End`` group) goes through as a unit: none
of its operations runs before the peers have posted the counterparts of all of them (a group's
connections to a new peer are set up on the host before it starts; its send and receive with one peer
run fused; NCCL documentation, "Group Calls" and "Point-to-point communication"). So neighbours'
batches must mirror each other: a stage whose batch holds "send activation, receive gradient" waits
forever on a peer that must use that activation before it can send the gradient.

Here: what each action receives and sends (``action_messages``), a stage's batches and computes in host
order (``host_events``), the k-th-send-meets-k-th-receive pairing (``counterparts``) and the replay
itself (``replay``). ``p2p.py`` builds the batches the pipeline posts with this model and
``checks.check_exchanges`` replays them, raising on a deadlock or on a receive that would match
another micro-batch's message.
"""

from __future__ import annotations

from typing import Optional

from rayconv.parallel.pipeline.schedules import FORWARD, Action, Schedule
from rayconv.errors import ScheduleError


def action_messages(schedule: Schedule, stage: int,
                    action: Action) -> tuple[Optional[tuple], Optional[tuple]]:
    """What ``action`` on ``stage`` receives before it runs and sends after it, each as
    ``(kind, microbatch, source stage, destination stage, source virtual stage)`` or None. Kinds:
    ``"act"`` (a forward's output, sent to the next virtual stage), ``"grad"`` (a backward's input
    gradient, sent to the previous)."""
    P = schedule.num_stages
    last = P * schedule.virtual_stages - 1
    m, v = action.microbatch, action.chunk * P + stage
    if action.kind == FORWARD:
        recv = ("act", m, (v - 1) % P, stage, v - 1) if v > 0 else None
        send = ("act", m, stage, (v + 1) % P, v) if v < last else None
    else:
        recv = ("grad", m, (v + 1) % P, stage, v + 1) if v < last else None
        send = ("grad", m, stage, (v - 1) % P, v) if v > 0 else None
    return recv, send


def host_events(schedule: Schedule, plans: Optional[tuple]) -> list[list[tuple]]:
    """Per stage, its events in host order: ``("batch", [ops], posts index, batch index)`` and
    ``("compute", action index)``. An op is ``[kind, message, matched]``, kind "send" or "recv". With
    ``plans`` None: every operation alone, each send right after its action (the unpaired pattern)."""
    events: list[list[tuple]] = []
    for s, prog in enumerate(schedule.programs):
        msgs = [action_messages(schedule, s, a) for a in prog]
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


def counterparts(schedule: Schedule, events: list[list[tuple]]) -> dict[int, list]:
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
                        f" (virtual stage {msg[4]})" if schedule.virtual_stages > 1 else "")
                raise ScheduleError(
                    f"schedule {schedule.name!r}: message {k} from stage {key[0]} to stage {key[1]} is "
                    f"{what(a[1])} but stage {key[1]} expects {what(b[1])}: messages between two stages "
                    "arrive in the order they were sent")
        if len(out) != len(inn):
            raise ScheduleError(
                f"schedule {schedule.name!r}: stage {key[0]} sends {len(out)} messages to stage "
                f"{key[1]}, which receives {len(inn)}")
    peer = {}
    for key in sent:
        for a, b in zip(sent[key], recvd[key]):
            peer[id(a)], peer[id(b)] = b, a
    return peer


def replay(events: list[list[tuple]], peer: dict[int, list]) -> list[tuple[int, int]]:
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

"""Tests for rayconv.parallel.pipeline's schedules, exchanges and simulation (pure Python: no Ray, no
torch)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rayconv.parallel.pipeline import (
    SCHEDULE_NAMES,
    Action,
    Post,
    Schedule,
    ScheduleError,
    bubble_fraction,
    check_exchanges,
    p2p_posts,
    format_grid,
    forward_only,
    interleaved_1f1b,
    gpipe,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    timeline,
    validate,
)
from rayconv.parallel.pipeline.simulate import simulate
from rayconv.parallel.pipeline.p2p import _round_posts  # the exchange model itself
from rayconv.parallel.pipeline.nccl_model import counterparts, host_events, action_messages, replay

SIZES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (2, 8), (3, 2), (4, 4), (4, 8), (4, 2)]


def F(m: int) -> Action:
    return Action("F", m)


def B(m: int) -> Action:
    return Action("B", m)


def _parse(text: str) -> tuple[Action, ...]:
    return tuple(Action(tok[0], int(tok[1:])) for tok in text.split())


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", SIZES)
def test_builtin_schedules_validate_and_are_well_formed(name: str, P: int, M: int) -> None:
    sched = make_schedule(name, P, M)
    assert sched.name == name
    assert (sched.num_stages, sched.num_microbatches) == (P, M)
    assert len(sched.programs) == P
    validate(sched)  # must not raise
    for prog in sched.programs:
        assert len(prog) == 2 * M
        assert sorted(prog, key=lambda a: (a.kind, a.microbatch)) == [B(m) for m in range(M)] + [
            F(m) for m in range(M)
        ]
        for m in range(M):
            assert prog.index(F(m)) < prog.index(B(m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", SIZES)
def test_simulated_grid_respects_dependencies(name: str, P: int, M: int) -> None:
    grid = simulate(make_schedule(name, P, M))
    assert len(grid) == P
    assert len({len(row) for row in grid}) == 1
    tick = {(s, a): t for s, row in enumerate(grid) for t, a in enumerate(row) if a is not None}
    assert len(tick) == 2 * M * P
    for m in range(M):
        for s in range(1, P):
            assert tick[(s, F(m))] > tick[(s - 1, F(m))]
        for s in range(P - 1):
            assert tick[(s, B(m))] > tick[(s + 1, B(m))]
    # Unit-time makespan of both schedules is 2 * (M + P - 1) ticks.
    assert len(grid[0]) == 2 * (M + P - 1)


@pytest.mark.parametrize("P,M", SIZES)
def test_peak_in_flight(P: int, M: int) -> None:
    assert peak_in_flight(gpipe(P, M)) == [M] * P
    peaks = peak_in_flight(one_f_one_b(P, M))
    for s, peak in enumerate(peaks):
        assert peak <= P - s
        assert peak == min(P - s, M)


@pytest.mark.parametrize("P,M", SIZES)
def test_gpipe_bubble_fraction_exact(P: int, M: int) -> None:
    expected = Fraction(P - 1, M + P - 1)
    assert bubble_fraction(gpipe(P, M)) == float(expected)
    # Non-interleaved 1F1B has the same bubble as GPipe (PipeDream-Flush sec. 3.1).
    assert bubble_fraction(one_f_one_b(P, M)) == float(expected)


def test_bubble_fraction_values() -> None:
    assert bubble_fraction(gpipe(1, 4)) == 0.0
    assert bubble_fraction(gpipe(2, 4)) == 0.2
    assert bubble_fraction(gpipe(4, 4)) == 3 / 7


def test_one_f_one_b_programs_match_megatron_order() -> None:
    sched = one_f_one_b(4, 8)
    assert sched.programs[0] == _parse("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7")
    assert sched.programs[2] == _parse("F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7")
    assert sched.programs[3] == _parse("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7")
    # More stages than micro-batches: warm-up is capped at M.
    assert one_f_one_b(4, 2).programs[0] == _parse("F0 F1 B0 B1")


def test_gpipe_program_order() -> None:
    assert gpipe(3, 3).programs == (_parse("F0 F1 F2 B0 B1 B2"),) * 3


def test_simulate_exact_grid_small() -> None:
    grid = simulate(gpipe(2, 2))
    assert grid == [[F(0), F(1), None, None, B(0), B(1)], [None, F(0), F(1), B(0), B(1), None]]


def test_timeline_with_measured_times_and_link() -> None:
    """The duration-aware model benchmarks/stage_times.py predicts a step with, worked by hand:
    1F1B, P = 2, M = 2; forwards take 1 and 2, backwards 3 and 4 (stage 0, 1); links take 0.5."""
    times = timeline(one_f_one_b(2, 2), forward=[1, 2], backward=[3, 4], link=0.5)
    # stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1
    assert times == [[(0, 1), (1, 2), (8, 11), (14, 17)],
                     [(1.5, 3.5), (3.5, 7.5), (7.5, 9.5), (9.5, 13.5)]]
    # Unit times and free links: the grid's ticks.
    sched = make_schedule("1f1b", 3, 6, 2)
    grid = simulate(sched)
    assert [[grid[s].index(a) for a in prog] for s, prog in enumerate(sched.programs)] == \
        [[start for start, _ in row] for row in timeline(sched)]


def test_format_grid() -> None:
    text = format_grid(gpipe(2, 2))
    assert text.splitlines() == ["stage 0 | F0 F1 .  .  B0 B1", "stage 1 | .  F0 F1 B0 B1 ."]
    for P, M in [(4, 8), (3, 12)]:
        sched = one_f_one_b(P, M)
        lines = format_grid(sched).splitlines()
        assert len(lines) == P
        assert [ln.split(" | ")[0] for ln in lines] == [f"stage {s}" for s in range(P)]
        # Aligned: cells have the width of the widest action plus one space.
        width = len(str(F(M - 1))) + 1
        for row, line in zip(simulate(sched), lines):
            body = line.split(" | ")[1]
            cells = [body[i : i + width].strip() for i in range(0, len(body), width)]
            assert cells == ["." if a is None else str(a) for a in row]


def test_format_grid_label_alignment_many_stages() -> None:
    lines = format_grid(gpipe(11, 1)).splitlines()
    assert len(lines) == 11
    assert lines[0].startswith("stage  0 | ")
    assert lines[10].startswith("stage 10 | ")


def test_real_deadlock_raises() -> None:
    sched = Schedule("bad", 2, 2, (_parse("F0 B0 F1 B1"), _parse("F1 B1 F0 B0")))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(sched)
    msg = str(info.value)
    assert "stage 0 waits at B0" in msg
    assert "stage 1 waits at F1" in msg
    with pytest.raises(ScheduleError):
        simulate(sched)
    with pytest.raises(ScheduleError):
        bubble_fraction(sched)


def test_backward_before_forward_raises() -> None:
    sched = Schedule("bad", 2, 1, (_parse("F0 B0"), _parse("B0 F0")))
    with pytest.raises(ScheduleError, match="stage 1: B0 comes before F0"):
        validate(sched)


def test_missing_microbatch_raises() -> None:
    sched = Schedule("bad", 2, 3, (_parse("F0 F1 F2 B0 B1 B2"), _parse("F0 F1 B0 B1")))
    with pytest.raises(ScheduleError, match=r"stage 1: .*missing B2 F2"):
        validate(sched)
    with pytest.raises(ScheduleError):
        peak_in_flight(sched)


def test_duplicate_and_out_of_range_raise() -> None:
    dup = Schedule("bad", 1, 2, (_parse("F0 F0 F1 B0 B1"),))
    with pytest.raises(ScheduleError, match="duplicated F0"):
        validate(dup)
    extra = Schedule("bad", 1, 1, (_parse("F0 B0 F1 B1"),))
    with pytest.raises(ScheduleError, match="unexpected B1 F1"):
        validate(extra)


def test_wrong_number_of_programs_raises() -> None:
    sched = Schedule("bad", 3, 1, (_parse("F0 B0"), _parse("F0 B0")))
    with pytest.raises(ScheduleError, match="2 programs but num_stages=3"):
        validate(sched)


def test_schedule_error_is_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


def test_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match="allowed names: gpipe, 1f1b"):
        make_schedule("interleaved", 2, 4)
    assert SCHEDULE_NAMES == ("gpipe", "1f1b")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bad_sizes_raise(name: str) -> None:
    with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
        make_schedule(name, 0, 4)
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1"):
        make_schedule(name, 2, 0)


def test_action() -> None:
    assert str(F(3)) == "F3"
    assert str(B(12)) == "B12"
    assert F(1) == Action("F", 1) and F(1) != B(1)
    with pytest.raises(ValueError):
        Action("X", 0)
    with pytest.raises(ValueError):
        Action("F", -1)


# ---------------------------------------------------------------- exchanges under NCCL's rules


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", SIZES + [(5, 10), (8, 16)])
def test_paired_exchanges_of_every_schedule_complete_without_buffering(name, P, M):
    check_exchanges(make_schedule(name, P, M))  # raises on a deadlock or a mismatched message


@pytest.mark.parametrize("P,M", [(2, 2), (2, 4), (3, 4), (4, 8)])
def test_unpaired_1f1b_deadlocks_without_buffering(P, M):
    """Each send and receive posted alone on the pair's stream (not paired in one group): in 1F1B's
    steady state neighbours send to each other at once and each send waits for a receive queued
    behind the peer's own send (tests/gpu/nccl_crossing.py --unpaired shows it on two GPUs)."""
    with pytest.raises(ScheduleError, match=r"deadlocks when sends are not buffered \(unpaired") as err:
        check_exchanges(one_f_one_b(P, M), paired=False)
    assert "stage 0 waits on [send act" in str(err.value)


@pytest.mark.parametrize("P,M", [(2, 1), (2, 4), (4, 8)])
def test_unpaired_gpipe_and_single_microbatch_1f1b_do_not_cross(P, M):
    # GPipe sends all activations, then all gradients: no two neighbours send to each other at once.
    check_exchanges(gpipe(P, M), paired=False)
    check_exchanges(one_f_one_b(P, 1), paired=False)


def _batches_with(sched, stage, peer):
    """The messages of each batch ``stage`` posts that go to or come from ``peer``, in posting order."""
    out = []
    for posts in p2p_posts(sched, stage):
        for post in posts:
            msgs = [action_messages(sched, stage, sched.programs[stage][j])[1] for j in post.sends] + \
                   [action_messages(sched, stage, sched.programs[stage][j])[0] for j in post.recvs]
            mine = {m for m in msgs if peer in (m[2], m[3])}
            if mine:
                out.append(mine)
    return out


ALL_PLANS = (
    [make_schedule(n, P, M) for n in ("gpipe", "1f1b") for P, M in SIZES + [(5, 10)]]
    + [interleaved_1f1b(P, M, V) for P, M, V in [(2, 2, 2), (2, 4, 2), (3, 3, 2), (3, 6, 2), (4, 8, 2)]]
    + [forward_only(P, M, V) for P, M, V in [(2, 3, 1), (2, 3, 2), (3, 5, 2), (4, 2, 3)]]
)


@pytest.mark.parametrize(
    "sched", ALL_PLANS, ids=lambda s: f"{s.name}-{s.num_stages}-{s.num_microbatches}-{s.virtual_stages}"
)
def test_neighbours_batches_mirror_each_other(sched):
    """NCCL runs a group as one unit, so the k-th batch of stage a with stage b must hold exactly the
    counterparts of the k-th batch of b with a."""
    for a in range(sched.num_stages):
        for b in range(sched.num_stages):
            if a != b:
                assert _batches_with(sched, a, b) == _batches_with(sched, b, a), (a, b)
        assert all(p.sends or p.recvs for posts in p2p_posts(sched, a) for p in posts)  # no empty batch


def test_gpipe_posts_its_last_activation_apart_from_its_first_gradient():
    """The round rule pairs stage 0's send of F3's activation with B0's receive. Stage 1 needs that
    activation (F3) before it can send B0's gradient, so as one NCCL group it can never complete (NCCL
    runs a group as one unit); the plan posts them as two batches."""
    sched = gpipe(2, 4)
    round_events = host_events(sched, tuple(tuple((p,) for p in _round_posts(sched, s)) for s in range(2)))
    stuck = replay(round_events, counterparts(sched, round_events))
    assert [s for s, _ in stuck] == [0, 1]
    assert [op[1][:2] for op in round_events[0][stuck[0][1]][1]] == [("act", 3), ("grad", 0)]
    plan = p2p_posts(sched, 0)
    # before B0: send F3's output, then receive B0's gradient
    assert plan[4] == (Post((3,), ()), Post((), (4,)))
    check_exchanges(sched)


def test_the_exchange_model_runs_a_batch_as_one_unit():
    """A batch's send goes through only once the peer has posted the counterpart of every operation
    in it: the same exchange, replayed with each operation as a unit of its own, completes."""
    sched = one_f_one_b(2, 1)
    round_events = host_events(sched, tuple(tuple((p,) for p in _round_posts(sched, s)) for s in range(2)))
    assert replay(round_events, counterparts(sched, round_events))  # stage 0: [send act0, recv grad0]
    per_op = host_events(sched, None)
    assert replay(per_op, counterparts(sched, per_op)) == []


def test_validate_rejects_a_schedule_that_receives_micro_batches_out_of_send_order():
    """Stage 1 runs F1 before F0. With buffered sends that is fine (``simulate`` accepts it), but
    messages between two stages match in posting order: F1 would compute on micro-batch 0's activation."""
    sched = Schedule("swapped", 2, 2, (_parse("F0 F1 B0 B1"), _parse("F1 F0 B1 B0")))
    simulate(sched)
    with pytest.raises(ScheduleError, match="message 0 from stage 0 to stage 1 is act of micro-batch 0 but "
                                            "stage 1 expects act of micro-batch 1"):
        validate(sched)


# ---------------------------------------------------------------- interleaved 1F1B


INTERLEAVED = [(2, 2, 2), (2, 4, 2), (2, 8, 2), (2, 4, 3), (3, 3, 2), (3, 6, 2), (3, 12, 3), (4, 8, 2),
               (4, 16, 4)]


@pytest.mark.parametrize("P,M,V", INTERLEAVED)
def test_interleaved_1f1b_is_valid_and_its_exchanges_complete_unbuffered(P, M, V):
    sched = interleaved_1f1b(P, M, V)
    validate(sched)  # programs, the unit-time simulation and check_exchanges
    assert sched.virtual_stages == V and all(len(p) == 2 * M * V for p in sched.programs)


@pytest.mark.parametrize("P,M,V", [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 16, 4)])
def test_interleaving_shrinks_the_bubble_by_the_chunk_count(P, M, V):
    """Each action is 1/V of a stage's work, so the unit-time grid measures the bubble: (P - 1) / (V M + P -
    1) when M > P (Narayanan et al. 2021, section 2.2.2), against (P - 1) / (M + P - 1) for 1F1B."""
    assert bubble_fraction(interleaved_1f1b(P, M, V)) == pytest.approx((P - 1) / (V * M + P - 1))
    assert bubble_fraction(one_f_one_b(P, M)) == pytest.approx((P - 1) / (M + P - 1))


def test_interleaved_first_stage_program_follows_megatron_order():
    # P=2, M=4, V=2: forwards in groups of P per chunk (F0 F1 on chunk 0, then on chunk 1), 4 warm-up forwards
    # on
    # stage 0 ((P - 1) * 2 + (V - 1) * P), backwards chunk 1 first.
    prog = " ".join(map(str, interleaved_1f1b(2, 4, 2).programs[0]))
    assert prog == "F0 F1 F0c1 F1c1 F2 B0c1 F3 B1c1 F2c1 B0 F3c1 B1 B2c1 B3c1 B2 B3"


def test_interleaved_exchanges_crossing_messages_in_one_batch():
    """Stage 0 of P=2, V=2: after each steady-state pair one batch sends both outputs and receives what
    Megatron-LM's round receives, each into the next action of its chunk that needs it."""
    sched = interleaved_1f1b(2, 4, 2)
    plan = p2p_posts(sched, 0)
    prog = sched.programs[0]
    assert all(len(posts) <= 1 for posts in plan)  # Megatron's rounds already mirror: none is split
    names = [[str(prog[j]) for posts in plan[i:i + 1] for p in posts for j in (p.sends + p.recvs)]
             for i in range(len(plan))]
    # after the pair (F2, B0c1): send both, receive B1c1's gradient
    assert names[6] == ["F2", "B0c1", "B1c1"]
    assert names[8] == ["F3", "B1c1", "F2c1", "B0"]   # send both, receive F2c1's input and B0's gradient


def test_without_megatron_rounds_interleaving_deadlocks_unbuffered():
    """The pairing that serves 1F1B (each action's sends with the next action's receive) is not enough for
    interleaved 1F1B: neighbours' crossing sends then sit in batches that do not match."""
    sched = interleaved_1f1b(2, 4, 2)
    with pytest.raises(ScheduleError, match="deadlocks when sends are not buffered"):
        check_exchanges(sched, paired=False)


@pytest.mark.parametrize("P,M,V", [(2, 1, 1), (2, 3, 2), (3, 5, 2), (4, 2, 3)])
def test_forward_only_programs_exchange_without_deadlock(P, M, V):
    check_exchanges(forward_only(P, M, V))


@pytest.mark.parametrize("P,M,V,match", [
    (1, 4, 2, "at least 2 pipeline stages"), (2, 3, 2, "not a multiple of --pp 2"),
    (2, 4, 1, "at least 2 model chunks")])
def test_interleaved_1f1b_refuses_bad_sizes(P, M, V, match):
    with pytest.raises(ValueError, match=match):
        interleaved_1f1b(P, M, V)


def test_model_chunks_need_the_1f1b_schedule():
    with pytest.raises(ValueError, match="need the 1f1b schedule"):
        make_schedule("gpipe", 2, 4, 2)

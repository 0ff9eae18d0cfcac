"""The driver's scaling and failure policies alone (``driver.policies``): plain inputs, one decision,
no Ray. The elastic run that carries the decisions out is tests/ops/test_multinode.py's
``test_elastic_dp4_shrinks_grows_and_loses_no_step``."""

from __future__ import annotations

import pytest

from rayconv.driver.policies import (CONTINUE, GROW, Decision, ElasticScaling, FailurePolicy, FixedScaling,
                                     plan_mesh)
from rayconv.mesh import Mesh


def elastic(start=Mesh(4, 1, 1), minimum=2, batch=96, micro=1, fits=lambda mesh: True) -> ElasticScaling:
    return ElasticScaling(start, minimum, batch, micro, fits)


def test_plan_keeps_pp_and_fs_and_shrinks_dp_to_what_fits_and_splits_the_batch():
    assert plan_mesh(Mesh(4, 1, 1), 2, 96, 1) == Mesh(2, 1, 1)
    assert plan_mesh(Mesh(4, 1, 1), 3, 96, 1) == Mesh(3, 1, 1)       # (an uneven split is exact too)
    assert plan_mesh(Mesh(4, 1, 1), 9, 96, 1) == Mesh(4, 1, 1)       # never above the starting dp
    assert plan_mesh(Mesh(2, 2, 1), 5, 96, 4) == Mesh(2, 2, 1)
    assert plan_mesh(Mesh(4, 2, 2), 11, 96, 1) == Mesh(2, 2, 2)
    # 12 images over dp3 are 4 per replica, not 3 micro-batches: dp2 (6 each) is the largest that splits.
    assert plan_mesh(Mesh(4, 1, 1), 3, 12, 3) == Mesh(2, 1, 1)
    assert plan_mesh(Mesh(2, 2, 2), 3, 96, 1) is None                 # not even one pp2 x fs2 replica
    assert plan_mesh(Mesh(4, 1, 1), 4, 96, 1, fits=lambda m: m.dp >= 3) == Mesh(4, 1, 1)
    assert plan_mesh(Mesh(4, 1, 1), 2, 96, 1, fits=lambda m: m.dp >= 3) is None   # (memory)


def test_a_preemption_notice_resizes_at_the_next_boundary_but_not_after_the_last_step():
    policy = elastic()
    d = policy.at_boundary(5, 10, checkpoint_due=False, current=Mesh(4, 1, 1), free=0,
                           preempted="actor dp1 got SIGTERM")
    assert d == Decision("resize", None, "actor dp1 got SIGTERM")   # (the layout: picked once they stopped)
    assert policy.at_boundary(10, 10, True, Mesh(4, 1, 1), 0, preempted="node ab is draining") == CONTINUE
    assert policy.at_boundary(5, 10, True, Mesh(4, 1, 1), 8) == CONTINUE   # (the full layout already)


def test_a_shrunk_run_grows_back_at_a_checkpoint_once_the_starting_layout_fits():
    policy = elastic()
    assert policy.at_boundary(6, 10, checkpoint_due=True, current=Mesh(2, 1, 1), free=2) == \
        Decision("resize", Mesh(4, 1, 1), GROW)
    assert policy.at_boundary(6, 10, checkpoint_due=True, current=Mesh(2, 1, 1), free=1) == CONTINUE   # 3 < 4
    assert policy.at_boundary(7, 10, checkpoint_due=False, current=Mesh(2, 1, 1), free=2) == CONTINUE
    # the wait before new actors start: the starting layout's devices for a grow, else those that ran
    assert policy.devices_to_wait_for(Mesh(2, 1, 1), GROW) == 4
    assert policy.devices_to_wait_for(Mesh(2, 1, 1), "actor dp1 got SIGTERM") == 2


def test_after_a_stop_the_layout_is_the_rule_s_then_a_wait_then_a_stop_below_the_minimum():
    policy = elastic(minimum=3)
    assert policy.choose(free=8, waited_out=False) == Decision("resize", Mesh(4, 1, 1))
    assert policy.choose(free=3, waited_out=True) == Decision("resize", Mesh(3, 1, 1))
    assert policy.choose(free=2, waited_out=False) == \
        Decision("wait", why="2 devices free, --elastic needs 3")
    stop = policy.choose(free=2, waited_out=True)
    assert stop.action == "stop" and stop.mesh is None and "--elastic needs 3" in stop.why
    # --max-memory-gib rules out the layouts that would fit the devices: below the minimum too
    assert elastic(minimum=1, fits=lambda m: m.dp == 4).choose(free=3, waited_out=True).action == "stop"


def test_a_fixed_layout_never_resizes_and_continues_on_the_same_layout_after_a_loss():
    policy = FixedScaling(Mesh(2, 2, 1))
    assert not policy.watches_cluster and elastic().watches_cluster
    assert policy.at_boundary(3, 10, True, Mesh(2, 2, 1), 100, preempted="node ab is draining") == CONTINUE
    assert policy.choose(free=0, waited_out=True) == Decision("resize", Mesh(2, 2, 1))


def test_the_failure_policy_restarts_resizes_or_stops_by_the_count():
    lost = "actor dp0 was lost"
    assert FailurePolicy(2).decide(lost, True, 0) == Decision("restart", why=lost)
    assert FailurePolicy(2).decide("actor dp0 was lost", True, 1).action == "restart"
    stop = FailurePolicy(2).decide("actor dp0 was lost", True, 2)
    assert stop.action == "stop" and stop.why.startswith("2 of --max-failures 2 recovered: give --max-")
    assert FailurePolicy(-1).decide("lost", True, 1000).action == "restart"   # (-1: no limit)
    assert FailurePolicy(0).decide("lost", True, 0).action == "stop"   # (no budget: the first loss stops)
    assert FailurePolicy(5).decide("refused", False, 0) == Decision("stop", why="refused")   # not recoverable
    assert FailurePolicy(2, elastic=True).decide("node lost", True, 1) == Decision("resize", why="node lost")
    assert FailurePolicy(2, elastic=True).decide("node lost", True, 2).action == "stop"


def test_a_decision_is_one_of_the_actions():
    with pytest.raises(ValueError, match="not one of"):
        Decision("grow")

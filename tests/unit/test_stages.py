"""Pipeline stage cuts (rayconv.parallel.pipeline.stages): balance is optimal (against brute force),
parse_stages reads --stages and refuses bad ones; make_routing refuses more chunks than layers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rayconv.config import Config
from rayconv.errors import LayoutError
from rayconv.mesh import Mesh
from rayconv.models import build_model
from rayconv.parallel.routing import make_routing
from rayconv.parallel.pipeline.stages import balance, parse_stages


def _max_stage(costs, bounds):
    return max(sum(costs[a:b]) for a, b in bounds)


def _brute_force(costs, k):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        best = min(best, _max_stage(costs, list(zip(edges, edges[1:]))))
    return best


def _check_bounds(bounds, n, k):
    assert len(bounds) == k
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds)                               # non-empty
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))  # contiguous


@pytest.mark.parametrize("costs, k, want", [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),
    ([1, 1, 1, 1, 1, 5], 2, [(0, 5), (5, 6)]),
    ([3, 3, 3], 3, [(0, 1), (1, 2), (2, 3)]),
    ([0, 0, 0], 3, [(0, 1), (1, 2), (2, 3)]),
    ([4, 2, 7], 1, [(0, 3)]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [(0, 5), (5, 7), (7, 9)]),  # 15 | 13 | 17: max 17 is optimal
])
def test_balance_hand_cases(costs, k, want):
    got = balance(costs, k)
    _check_bounds(got, len(costs), k)
    assert _max_stage(costs, got) == _max_stage(costs, want) == _brute_force(costs, k)
    if costs != [1, 2, 3, 4, 5, 6, 7, 8, 9]:   # unique optimum
        assert got == want


def test_balance_is_optimal_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        costs = [float(c) for c in rng.integers(0, 20, n)]
        got = balance(costs, k)
        _check_bounds(got, n, k)
        assert _max_stage(costs, got) == _brute_force(costs, k), (costs, k, got)


def test_balance_more_stages_than_layers():
    with pytest.raises(LayoutError, match="--pp"):
        balance([1.0, 2.0], 3)


def test_parse_stages():
    assert parse_stages("5,9", 12, 3) == [(0, 5), (5, 9), (9, 12)]
    assert parse_stages(" 5 , 9 ", 12, 3) == [(0, 5), (5, 9), (9, 12)]
    assert parse_stages("1", 2, 2) == [(0, 1), (1, 2)]
    assert parse_stages("", 12, 1) == [(0, 12)]


@pytest.mark.parametrize("spec, layers, stages, match", [
    ("5", 12, 3, "--pp"),          # too few cut points
    ("3,5,9", 12, 3, "--pp"),      # too many
    ("9,5", 12, 3, "--stages"),    # decreasing
    ("5,5", 12, 3, "--stages"),    # empty stage
    ("0,5", 12, 3, "--stages"),    # empty first stage
    ("5,12", 12, 3, "--stages"),   # empty last stage
    ("a,b", 12, 3, "--stages"),    # not integers
])
def test_parse_stages_errors(spec, layers, stages, match):
    with pytest.raises(LayoutError, match=match):
        parse_stages(spec, layers, stages)


def test_more_chunks_than_layers_is_a_plan_error():
    cfg = Config(model="convnet", data="digits", pp=2, dp=1, virtual_stages=7, num_microbatches=2,
                 global_batch_size=8).validate()
    with pytest.raises(LayoutError,
                       match="into 14 chunks but it has 12 cuttable layers: lower --virtual-stages"):
        make_routing(cfg, Mesh(dp=1, pp=2, fs=1), build_model("convnet", 10, 1, 8), (1, 8, 8))

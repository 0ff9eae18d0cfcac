"""Pipeline stages: the flat layer list cut into contiguous runs of layers, one per (virtual) stage
(GPipe, Huang et al. 2019, section 2.2). ``balance`` cuts them so that the largest stage cost is
smallest (cost per layer: forward FLOPs from ``torch.utils.flop_counter``, parameter count, or
measured time); ``parse_stages`` reads the cut points a user gives (``--stages``). Plain Python: no
torch, so the planner's cost model imports it.
"""

from __future__ import annotations

from typing import Sequence

from rayconv.errors import LayoutError


def balance(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Cut ``costs`` (one per layer) into ``num_stages`` contiguous non-empty runs minimising the
    largest run's sum (linear partition by dynamic programming, O(L^2 * P)). Returns [start, end) pairs.
    Raises LayoutError if there are fewer layers than stages."""
    n = len(costs)
    if num_stages > n:
        raise LayoutError(
            f"--pp {num_stages} needs at least {num_stages} cuttable layers but the model has {n}: "
            f"lower --pp to at most {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal max-stage cost splitting the first i layers into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def parse_stages(spec: str, num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``--stages '5,9'``: the first layer index of stages 1.. (so 3 stages: [0,5), [5,9), [9,L)).
    Raises LayoutError naming what to change."""
    try:
        cuts = [int(s) for s in spec.replace(" ", "").split(",") if s]
    except ValueError:
        raise LayoutError(f"--stages {spec!r}: give comma-separated layer indices, e.g. '5,9'") from None
    if len(cuts) != num_stages - 1:
        raise LayoutError(
            f"--stages {spec!r} gives {len(cuts) + 1} stages but --pp (times --virtual-stages) is "
            f"{num_stages}: give {num_stages - 1} cut point(s)")
    edges = [0, *cuts, num_layers]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise LayoutError(f"--stages {spec!r}: cut points must increase strictly within 1..{num_layers - 1}")
    return list(zip(edges, edges[1:]))

"""The device mesh: the only place that does rank arithmetic.

A job runs on ``world_size = dp * pp * fs`` actors laid out on a 3-d mesh with axes (dp, pp, fs),
fs innermost, so ranks ``r, r+1, ...`` of one filter-split group are neighbours: ranks are assigned
to actors sorted by (node, GPU), so the chattiest axis (fs) stays on the fastest links inside a node
(as torchtitan's DeviceMesh and Megatron's rank order do).

    rank = (d * pp + p) * fs + f

A *group* along an axis is the set of ranks that differ only in that axis' coordinate: the dp group of
a rank averages gradients of the same part; the pp group is one pipeline; the fs group splits
filters of the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

AXES = ("dp", "pp", "fs")


class Coord(NamedTuple):
    dp: int
    pp: int
    fs: int


@dataclass(frozen=True)
class Mesh:
    """Mesh(dp, pp, fs) of actors. Raises ValueError for degrees < 1."""

    dp: int = 1
    pp: int = 1
    fs: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh degree {axis}={getattr(self, axis)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.fs

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.fs)

    def rank(self, coord: Coord | tuple[int, int, int]) -> int:
        d, p, f = coord
        assert 0 <= d < self.dp and 0 <= p < self.pp and 0 <= f < self.fs, (coord, self)
        return (d * self.pp + p) * self.fs + f

    def coord(self, rank: int) -> Coord:
        assert 0 <= rank < self.world_size, (rank, self)
        f = rank % self.fs
        p = (rank // self.fs) % self.pp
        d = rank // (self.fs * self.pp)
        return Coord(d, p, f)

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis``: lists of ranks differing only in that coordinate, in a fixed order
        (every rank must create process groups in the same order)."""
        i = AXES.index(axis)
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coord(r)
            key = tuple(v for j, v in enumerate(c) if j != i)
            out.setdefault(key, []).append(r)
        return [out[k] for k in sorted(out)]

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks of ``rank``'s group along ``axis`` (in coordinate order)."""
        for g in self.groups(axis):
            if rank in g:
                return g
        raise AssertionError("every rank is in one group per axis")

    def role(self, rank: int) -> str:
        """A short role name for dashboards and errors, e.g. ``dp1`` or ``dp0-pp1-fs0``."""
        c = self.coord(rank)
        parts = [f"{a}{v}" for a, v, n in zip(AXES, c, self.shape) if n > 1]
        return "-".join(parts) or "dp0"

    def describe(self) -> str:
        return (
            f"dp={self.dp} x pp={self.pp} x fs={self.fs} ({self.world_size}"
            f" actor{'' if self.world_size == 1 else 's'})"
        )


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous slices of ``n`` items, as even as possible (first ones larger)."""
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def split_slices(n: int, parts: int) -> list[slice]:
    out, start = [], 0
    for size in split_sizes(n, parts):
        out.append(slice(start, start + size))
        start += size
    return out

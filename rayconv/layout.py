"""One layout of a job and its name: the vocabulary shared by the bench, the planner and the driver.

A ``Layout`` says how a model is spread over ``dp * pp * fs`` actors: the mesh degrees, the per-layer
plan (``krizhevsky2014``: conv layers data parallel over ``dp`` actors, FC layers filter-split over
the same actors; Krizhevsky 2014, section 4), the pipeline's micro-batches, schedule and virtual
stages, and the pieces filter split's gathers are cut into (``exchange_chunks``).

Its name is parts joined by ``x``, in the order dp, pp, fs, and an optional ``-gpipe`` or ``-1f1b``:

    1gpu            one actor                  plan2         the per-layer plan over 2 actors
    dp2             2 data-parallel replicas   fs2c4         filter split, each gather in 4 pieces
    pp2m4           2 stages, 4 micro-batches  pp2m4v2       the same, 2 model chunks per stage
    pp2m4-gpipe     GPipe instead of 1F1B      dp2xpp2m4v2   2 replicas of that pipeline

``pp2`` leaves the micro-batches unset (``num_microbatches`` None: ``rayconv.run``'s default, 1; the
bench tries 2, 4 and 8). Names the parser refuses raise ``ConfigError`` with a one-line message that
says what to write instead. The fields are ``rayconv.settings.LayoutFields``, declared once there for
Config's flags and Layout alike. The module imports only ``settings``, ``errors`` and ``mesh``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from rayconv.errors import ConfigError
from rayconv.mesh import Mesh
from rayconv.settings import LayoutFields

PLAN = "krizhevsky2014"  # the per-layer plan a ``plan<N>`` name stands for
EXAMPLES = "1gpu, dp2, fs2, fs2c4, pp2, pp2m4, pp2m4-gpipe, pp2m4v2, plan2, dp2xfs2"
_PART = re.compile(r"(dp|pp|fs|plan)(\d+)(?:m(\d+))?(?:v(\d+))?(?:c(\d+))?")


@dataclass(frozen=True)
class Layout(LayoutFields):
    """A mesh ``dp x pp x fs`` (or the per-layer plan over ``dp`` actors) with its pipeline settings:
    the fields of ``LayoutFields``, in its order, so ``to_config_fields`` feeds a Config.

    Two defaults differ from Config's: a layout names its replicas (``dp`` 1, where Config's None means
    all devices), and ``num_microbatches`` None means not fixed (``num_microbatches_or_1`` reads it as 1)."""

    dp: int = 1
    num_microbatches: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.fs

    @property
    def num_microbatches_or_1(self) -> int:
        """Micro-batches per replica per step (1 when not fixed)."""
        return self.num_microbatches or 1

    def mesh(self) -> Mesh:
        return Mesh(self.dp, self.pp, self.fs)

    @property
    def name(self) -> str:
        """The canonical name (``Layout.parse(lay.name) == lay`` for every layout a name can say;
        micro-batches without a pipeline and a schedule without one are not part of it)."""
        if self.plan != "none":
            return f"plan{self.dp}"
        parts = [f"dp{self.dp}"] if self.dp > 1 else []
        if self.pp > 1:
            m = "" if self.num_microbatches is None else f"m{self.num_microbatches}"
            parts.append(f"pp{self.pp}{m}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.fs > 1:
            parts.append(f"fs{self.fs}" + (f"c{self.exchange_chunks}" if self.exchange_chunks > 1 else ""))
        text = "x".join(parts) or "1gpu"
        return text + ("-gpipe" if self.pp > 1 and self.schedule == "gpipe" else "")

    @staticmethod
    def parse(name: str) -> "Layout":
        """The layout a name stands for (see the module's table). Raises ConfigError."""
        base, _, schedule = name.partition("-")
        if schedule and schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"unknown schedule {schedule!r} in layout {name}: use -gpipe or -1f1b")
        fields: dict[str, Any] = {"schedule": schedule} if schedule else {}
        if base in ("1gpu", "1"):
            return Layout(**fields)
        seen: set[str] = set()
        for part in base.split("x"):
            axis, values = _parse_part(base, part)
            if axis in seen:
                raise ConfigError(f"layout {name!r} names {axis} twice: give each of dp, pp, fs once")
            seen.add(axis)
            fields.update(values)
        if "plan" in seen and seen != {"plan"}:
            raise ConfigError(f"layout {name!r}: plan<N> spreads the model over all N actors itself; "
                              "write it alone, e.g. plan2")
        return Layout(**fields)

    @staticmethod
    def from_config(cfg: LayoutFields) -> "Layout":
        """The layout of a Config (or any ``LayoutFields``); ``cfg.dp`` must be resolved. Raises
        ValueError when it is not (a caller's mistake, not the user's)."""
        if cfg.dp is None:
            raise ValueError("Layout.from_config needs cfg.dp resolved against the cluster first")
        return Layout(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(LayoutFields)})

    def to_config_fields(self) -> dict[str, Any]:
        """The Config fields of this layout (micro-batches unset give Config's default, 1)."""
        return {**dataclasses.asdict(self), "num_microbatches": self.num_microbatches_or_1}


def _parse_part(name: str, part: str) -> tuple[str, dict[str, Any]]:
    """One ``x``-separated part of a name: (its axis, the fields it sets). Raises ConfigError."""
    m = _PART.fullmatch(part)
    axis = m.group(1) if m else ""
    if not m or ((m.group(3) or m.group(4)) and axis != "pp") or (m.group(5) and axis != "fs"):
        raise ConfigError(f"unknown layout {name!r}: use e.g. {EXAMPLES} (m and v belong to pp, c to fs)")
    if any(g is not None and int(g) == 0 for g in m.groups()[1:]):
        raise ConfigError(f"layout {name!r} has a zero count: every degree, micro-batch, chunk and piece "
                          "count is at least 1")
    n = int(m.group(2))
    if axis == "plan":
        return axis, {"dp": n, "plan": PLAN}
    out: dict[str, Any] = {axis: n}
    for key, group in (("num_microbatches", 3), ("virtual_stages", 4), ("exchange_chunks", 5)):
        if m.group(group):
            out[key] = int(m.group(group))
    return axis, out


__all__ = ["Layout", "PLAN", "EXAMPLES"]

"""Dynamic loss scaling for float16 training, agreed over the whole mesh.

float16 gradients underflow below 6e-8; multiplying the loss by a large scale S keeps them
representable, and the gradients are divided by S before the update (Micikevicius et al. 2018, "Mixed
Precision Training", section 3.2). ``DynamicLossScale`` adapts S as ``torch.amp.GradScaler`` does
(same defaults and the same arithmetic as its ``_amp_update_scale_``): start at 2**16, halve it and
skip the step when any gradient is inf or NaN, double it after 2000 steps in a row without one.

On a mesh every actor must skip the same steps and hold the same S, or replicas and parts drift
apart. So the overflow flag is an input: each actor computes ``local_overflow`` (or gets it from
``unscale_``), the caller all-reduces it with MAX over every actor of the mesh (dp x pp x fs), and every
actor then calls ``update`` with the agreed flag. One step, in order::

    (loss * scaler.scale).backward()                       # every micro-batch
    found = unscale_(params, scaler.scale)                 # grads / S, and this actor's flag
    all_reduce(found, MAX, whole mesh)                     # the caller's collective
    if not scaler.update(found): optimizer.step()          # skipped everywhere alike
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

from rayconv.errors import ConfigError


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _float32(x: float) -> float:
    """``x`` rounded to float32, where GradScaler keeps its scale (inf beyond float32's range)."""
    return float(torch.tensor(x, dtype=torch.float32))


def local_overflow(params: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """1.0 if any gradient of ``params`` holds an inf or NaN, else 0.0: a float32 0-dim tensor on the
    gradients' device (``device``, else CPU, when there are none), ready for an all-reduce with MAX.
    No host synchronisation."""
    grads = _grads(params)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    bad = torch.stack([torch.logical_not(torch.isfinite(g)).any().to(grads[0].device) for g in grads])
    return bad.any().to(torch.float32)


def unscale_(params: Iterable[torch.Tensor], scale: float,
             device: torch.device | None = None) -> torch.Tensor:
    """Divide every gradient of ``params`` by ``scale`` in place (times the float32 reciprocal, as
    ``GradScaler.unscale_``) and return ``local_overflow``'s flag for them, found by the same fused
    kernel GradScaler uses."""
    grads = _grads(params)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_kind[(g.device, g.dtype)].append(g)
    home = grads[0].device if grads else device
    found = torch.zeros((), dtype=torch.float32, device=home)
    inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    for (dev, _), group in by_kind.items():
        flag = torch.zeros(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv.to(dev))
        found = torch.maximum(found, flag.to(home).reshape(()))
    return found


class DynamicLossScale:
    """The loss scale and its update rule (``torch.amp.GradScaler``'s). ``scale``: the factor for this
    step's loss (a float, float32-rounded). Raises ConfigError for an ``init_scale`` or
    ``growth_factor`` not above 1 (init > 0), a ``backoff_factor`` outside (0, 1), ``growth_interval < 1``."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ConfigError(
                f"loss scaling needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                f"and growth_interval >= 1 (got {init_scale}, {growth_factor}, {backoff_factor}, "
                f"{growth_interval})")
        self.scale = _float32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # steps in a row without overflow since the last change

    def update(self, found_inf_global: bool | float | torch.Tensor) -> bool:
        """Advance the scale after a step whose overflow flag, agreed over the whole mesh, is
        ``found_inf_global`` (reading a tensor synchronises with its device). Returns True when the
        step must be skipped (an overflow: the scale is multiplied by ``backoff_factor``); else counts
        the step and, at ``growth_interval`` in a row, multiplies the scale by ``growth_factor`` unless
        that leaves float32's range."""
        found = bool(found_inf_global.item() if isinstance(found_inf_global,
                                                           torch.Tensor) else found_inf_global)
        if found:
            self.scale = _float32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return True
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _float32(self.scale * self.growth_factor)
            if grown != float("inf"):
                self.scale = grown
            self.growth_tracker = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        """The state under ``GradScaler.state_dict``'s keys (``scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``_growth_tracker``)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` (or a ``GradScaler``'s). Raises KeyError for a missing key."""
        self.scale = _float32(float(state["scale"]))
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(
            state["backoff_factor"]
        )
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])

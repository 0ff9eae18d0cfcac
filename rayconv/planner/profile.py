"""What the cost model knows of a model: per-layer sizes and parameters (``Profile``), the measured
layer times (``LayerTimes``), and the pipeline cut over them (``chunks_of``).

``planner.measure.profile_of`` fills a ``Profile`` from one CPU forward of one sample; the times are
measured on the device (``planner.measure.times_at``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from rayconv.parallel.pipeline.stages import balance

LayerTimes = Callable[[int, int], Sequence[float]]  # (batch size, fs) -> forward+backward ms per layer


@dataclass(frozen=True)
class Profile:
    """Per-layer facts of a model (``models.to_layers`` order). ``out_elems[i]``: elements of layer
    i's output per sample; ``params[i]``: parameters of layer i; ``in_elems``: elements of one input
    sample; ``first_fc``: index of the first Linear layer (None without one); ``gathers``: layers
    before which a filter split all-gathers its input (the output of the layer before them);
    ``max_fs``: the largest filter split the model allows (1: none, e.g. ResNets); ``flops[i]``: forward
    FLOPs of layer i per sample (``parallel.routing.layer_profile``); ``saved_elems[i]``: elements
    layer i saves for its backward pass per sample (``planner.measure.saved_elems``)."""

    model: str
    in_elems: int
    out_elems: tuple[int, ...]
    params: tuple[int, ...]
    first_fc: Optional[int] = None
    gathers: tuple[int, ...] = ()
    max_fs: int = 1
    flops: tuple[float, ...] = ()
    saved_elems: tuple[float, ...] = ()

    def saved(self, layers: Sequence[int]) -> float:
        """Elements per sample that ``layers`` keep for their backward pass (``saved_elems``; without
        it, their outputs and the first one's input)."""
        if self.saved_elems:
            return sum(self.saved_elems[i] for i in layers)
        return sum(self.out_elems[i] for i in layers) + self.act_in(layers[0])

    @property
    def num_layers(self) -> int:
        return len(self.params)

    def act_in(self, i: int) -> int:
        """Elements per sample of layer i's input."""
        return self.in_elems if i == 0 else self.out_elems[i - 1]


def chunks_of(costs: Sequence[float], num_virtual_stages: int) -> list[tuple[int, int]]:
    """The [start, end) layer ranges of ``num_virtual_stages`` virtual stages minimising the largest sum of
    ``costs`` (one range when 1): the pipeline's own cut (``parallel.pipeline.stages.balance``), so that
    the model cuts where the run cuts. Raises LayoutError for more chunks than layers."""
    return balance(costs, num_virtual_stages) if num_virtual_stages > 1 else [(0, len(costs))]


def stage_layers(chunks: Sequence[tuple[int, int]], pp: int, stage: int) -> list[int]:
    """The layers pipeline stage ``stage`` holds: its chunks ``stage, stage + pp, ...`` (interleaved)."""
    return [i for v in range(stage, len(chunks), pp) for i in range(*chunks[v])]


__all__ = ["Profile", "LayerTimes", "chunks_of", "stage_layers"]

"""Filter split (Krizhevsky et al. 2012, section 3.2; today's tensor parallelism) and Krizhevsky 2014's
per-layer plan, one concept a module:

    exchanges.py       the collectives along the split dimension as autograd functions (``Gather``,
                       ``Scatter``, ``BatchGather``) and the gather overlapped with its consumer
                       (``ExchangeSpec``, ``overlapped_gather``)
    layers.py          the layers an actor runs in place of the model's (``SlicedDropout``,
                       ``GatheredConv2d``, ``GatheredLinear``; ``COMM_MODULES``)
    split.py           a run of layers filter-split over F actors (``slice_layers``), or kept whole
                       (``whole_part``): one actor's ``SlicedPart``
    per_layer_plan.py  conv layers data parallel, FC layers split (``krizhevsky2014``)
"""

from rayconv.parallel.filter_split.exchanges import (
    BatchGather,
    ExchangeSpec,
    Gather,
    Scatter,
    overlapped_gather,
)
from rayconv.parallel.filter_split.layers import COMM_MODULES, GatheredConv2d, GatheredLinear, SlicedDropout
from rayconv.parallel.filter_split.per_layer_plan import krizhevsky2014
from rayconv.parallel.filter_split.split import SlicedPart, slice_layers, whole_part

__all__ = ["BatchGather", "COMM_MODULES", "ExchangeSpec", "Gather", "GatheredConv2d", "GatheredLinear",
           "Scatter", "SlicedDropout", "SlicedPart", "krizhevsky2014", "overlapped_gather", "slice_layers",
           "whole_part"]

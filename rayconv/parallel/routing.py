"""the routing: what the driver computes once and sends to every actor.

``make_routing`` views the model as its flat layer list (``models.to_layers``), measures each layer's
forward FLOPs and output shape with one CPU forward of a single sample, cuts the pipeline stages,
builds and validates the schedule, and checks the layout against the model. Everything here raises
``LayoutError`` (a ValueError) with what to change, before any actor starts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn

from rayconv.config import Config, batch_split_problem
from rayconv.mesh import Mesh
from rayconv.models import check_trainable, run_model, to_layers
from rayconv.models.traced import cut_problem
from rayconv.parallel.filter_split.per_layer_plan import krizhevsky2014
from rayconv.parallel.filter_split.split import SlicedPart, slice_layers, whole_part
from rayconv.parallel.pipeline.schedules import Schedule, make_schedule
from rayconv.parallel.pipeline.stages import balance, parse_stages
from rayconv.parallel.pipeline.checks import validate
from rayconv.errors import ConfigError, LayoutError, first_line


@dataclass(frozen=True)
class Routing:
    """Layout of one run, identical on every actor.

    ``layer_names``: qualified names of the flat layers; ``out_shapes[i]``: per-sample output shape
    of layer i (``in_shape`` for the input); ``flops[i]``: forward FLOPs of layer i per sample (None
    unless the pipeline stages were balanced by them: counting imports torch._dynamo and triton);
    ``stages``: [start, end) layer ranges, one per pipeline stage, or per virtual stage under
    interleaved 1F1B (``P * V`` of them; stage s holds ``virtual_stages(s)``); ``schedule``: the
    micro-batch program of each stage; ``per_layer_plan``: "none" or "krizhevsky2014" (``--plan``).
    """

    mesh: Mesh
    layer_names: tuple[str, ...]
    in_shape: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    flops: Optional[tuple[float, ...]]
    params: tuple[int, ...]
    stages: tuple[tuple[int, int], ...]
    schedule: Schedule
    per_layer_plan: str = "none"
    # filter split: batch pieces of each overlapped gather (filter_split.overlapped_gather)
    exchange_chunks: int = 1

    def stage_in_shape(self, stage: int) -> tuple[int, ...]:
        start = self.stages[stage][0]
        return self.in_shape if start == 0 else self.out_shapes[start - 1]

    def stage_out_shape(self, stage: int) -> tuple[int, ...]:
        return self.out_shapes[self.stages[stage][1] - 1]

    def stage_params(self) -> list[int]:
        """Parameters held by each pipeline stage (all its chunks)."""
        P = self.mesh.pp
        return [sum(sum(self.params[a:b]) for a, b in (self.stages[v] for v in self.virtual_stages(s)))
                for s in range(P)]

    def virtual_stages(self, stage: int) -> list[int]:
        """Indices into ``stages`` of the chunks pipeline stage ``stage`` holds: ``stage + c * P``."""
        return [stage + c * self.mesh.pp for c in range(self.schedule.virtual_stages)]


def layer_profile(layers: list[tuple[str, nn.Module]], sample_shape: tuple[int, ...],
                  count_flops: bool = True):
    """(per-sample output shapes, forward FLOPs per sample or None without ``count_flops``, parameter
    counts), one per layer, from one eval-mode CPU forward of a batch of 1."""
    if count_flops:  # (torch's FLOP counter imports torch._dynamo and triton: seconds, only to plan)
        from torch.utils.flop_counter import FlopCounterMode
    x = torch.zeros((1, *sample_shape))
    shapes, flops, params = [], [], []
    with torch.no_grad():
        for _, m in layers:
            was_training = m.training
            m.eval()
            counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
            try:
                with counter:
                    x = m(x)
            except RuntimeError as e:
                raise LayoutError(f"the model cannot take {tuple(sample_shape)} images "
                                  f"({first_line(e)}): pick a model for small images (convnet), or "
                                  "larger images (--image-size; digits are never resized: --data "
                                  "fashion-mnist)") from None
            m.train(was_training)
            shapes.append(tuple(x.shape[1:]))
            if count_flops:
                flops.append(float(counter.get_total_flops()))
            params.append(sum(p.numel() for p in m.parameters()))
    return shapes, flops if count_flops else None, params


def build_part(routing: Routing, layers, stage: int, fs_index: int, fs_group, dp_index: int,
               dp_group) -> tuple[SlicedPart, Optional[list[int]]]:
    """This actor's runnable part (a ``filter_split.SlicedPart``) and the slice sizes of its input
    (None when replicated): the stage's layers, filter-split over fs, or the per-layer plan.
    Stages before ``stage`` are sliced too (cheap slicing) to learn those sizes. Raises LayoutError for
    a layer that cannot be split; the driver calls it once with actor 0's coordinates to check."""
    if routing.per_layer_plan == "krizhevsky2014":
        return krizhevsky2014(layers, routing.in_shape, list(routing.out_shapes), dp_index, routing.mesh.dp,
                              dp_group), None
    if routing.schedule.virtual_stages > 1:
        # Interleaved 1F1B: the stage's chunks, one after the other (no filter split: the settings refuse it).
        return whole_part([layer for v in routing.virtual_stages(stage)
                           for layer in layers[routing.stages[v][0]:routing.stages[v][1]]]), None
    in_sizes = None
    for p, (start, end) in enumerate(routing.stages):
        if routing.mesh.fs == 1:
            part = whole_part(layers[start:end])
        else:
            part = slice_layers(layers[start:end], routing.stage_in_shape(p),
                                list(routing.out_shapes[start:end]), in_sizes, fs_index, routing.mesh.fs,
                                fs_group, is_last=p == routing.mesh.pp - 1,
                                exchange_chunks=routing.exchange_chunks)
        if p == stage:
            return part, in_sizes
        in_sizes = part.out_sizes
    raise AssertionError(f"stage {stage} out of range")


def make_routing(cfg: Config, mesh: Mesh, model: nn.Module, sample_shape: tuple[int, ...],
              costs: Optional[list[float]] = None) -> Routing:
    """the routing of ``model`` (built with the run's settings) for ``mesh``; pipeline stages balance
    ``costs`` (one per layer, e.g. measured times) when given, else forward FLOPs. Raises LayoutError."""
    layers = to_layers(model)
    by_flops = mesh.pp * cfg.virtual_stages > 1 and not cfg.stages and costs is None
    shapes, flops, params = layer_profile(layers, sample_shape, count_flops=by_flops)
    if mesh.pp > 1 and len(layers) == 1:
        raise LayoutError(f"--model {cfg.model} cannot be cut into pipeline stages ({cut_problem(model)}): "
                        "use --pp 1 (it trains data parallel)")
    chunks = mesh.pp * cfg.virtual_stages  # contiguous runs of layers; stage s holds s, s + P, ...
    if cfg.virtual_stages > 1 and chunks > len(layers):
        raise LayoutError(f"--pp {mesh.pp} with --virtual-stages {cfg.virtual_stages} cuts the model into "
                          f"{chunks} chunks but it has {len(layers)} cuttable layers: lower --virtual-stages")
    if cfg.stages:
        stages = parse_stages(cfg.stages, len(layers), chunks)
    elif costs is not None:
        if len(costs) != len(layers):
            raise LayoutError(f"{len(costs)} layer costs for {len(layers)} layers")
        stages = balance(costs, chunks)
    else:
        # Balance by forward FLOPs, parameters as a tie-breaker for layers without compute (one chunk:
        # every layer, no FLOPs counted).
        stages = balance([f + p for f, p in zip(flops or [0.0] * len(params), params)], chunks)
    # (checked once --dp is known: before the cluster decides it, the split is not yet known)
    problem = batch_split_problem(cfg.global_batch_size, mesh.dp, cfg.num_microbatches) if cfg.dp else None
    if problem:
        raise LayoutError(problem)
    try:
        schedule = make_schedule(cfg.schedule, mesh.pp, cfg.num_microbatches, cfg.virtual_stages)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    validate(schedule)
    routing = Routing(mesh=mesh, layer_names=tuple(n for n, _ in layers), in_shape=tuple(sample_shape),
                      out_shapes=tuple(shapes), flops=tuple(flops) if flops is not None else None,
                      params=tuple(params), stages=tuple(stages), schedule=schedule, per_layer_plan=cfg.plan,
                      exchange_chunks=cfg.exchange_chunks)
    build_part(routing, layers, mesh.pp - 1, 0, None, 0, None)  # refuse unsplittable layers before any actor
    return routing


def checked_routing(cfg: Config, mesh: Mesh, num_classes: int, sample_shape: tuple[int, ...],
                    data_channels: int, check: bool = True) -> tuple[nn.Module, Routing]:
    """(the run's whole model as every actor builds it, ``models.run_model``; its routing for ``mesh``),
    the model first checked (``check``) to train on the data: its forward maps (C, H, W) =
    ``sample_shape`` images to ``num_classes`` scores (``check_trainable``; ``data_channels``: the data's
    own channel count, before grey is repeated). Run by the driver, or for it by a kept actor
    (``driver.resolve.WarmCheck``). Raises ConfigError / LayoutError naming what to change."""
    data = SimpleNamespace(num_classes=num_classes, sample_shape=tuple(sample_shape))
    model = run_model(cfg, data)   # (with --init: its keys and shapes checked, its weights loaded)
    if check:
        classes = check_trainable(cfg.model, model, tuple(sample_shape), data_channels, cfg.data)[1]
        if classes != num_classes:
            raise ConfigError(f"--model {cfg.model} gives {classes} class scores, the data has {num_classes} "
                              "classes: build the model with the num_classes it is called with")
    return model, make_routing(cfg, mesh, model, tuple(sample_shape))

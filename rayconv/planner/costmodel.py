"""A cost model of one synchronous SGD step for every layout rayconv runs: predicted step time and its
split (compute, exchange, all-reduce, bubble), with peak memory per actor (``planner.memory``).

``rayconv/parallel/routing.py`` builds the *routing*
of one given layout (layers, stages, schedule, the per-layer plan ``--plan krizhevsky2014``) which
the actors run. This module *predicts* what a layout costs, so that ``planner.search`` (the
``python -m rayconv.plan`` command and ``--layout auto``) can rank layouts before any actor starts.
It runs no model and starts no actor: every input is measured elsewhere and passed in.

Inputs
------
* ``Profile`` (``planner.profile``): per layer of ``models.to_layers`` the per-sample output
  elements and parameter count, the first fully connected layer, and the layers a filter split
  gathers before.
* ``LayerTimes``: forward + backward time (ms) of each layer at a given batch size, whole or as one
  actor's slice of a filter split over ``fs`` actors (its own exchanges left out), measured on the
  device (``planner.measure.times_at``). The backward is taken as 2/3 of it (the usual 1 : 2
  forward : backward ratio of convolutions and matrix products; Narayanan et al. 2021, section 3.3).
* ``Links`` (``planner.links``): latency and bandwidth of all-reduce, all-gather and point-to-point
  transfers inside a node and between nodes (measured between actors, or from ``LINK_TABLE``).

The step of a layout (Yadan et al. 2013, section 3; Huang et al. 2019; Narayanan et al. 2021)
----------------------------------------------------------------------------------------------
* Each pipeline stage (``pp``, times ``virtual_stages`` chunks) runs its schedule's program
  (``parallel.pipeline.make_schedule``), each action taking its chunk's measured time at the micro-batch
  size (of the ``fs`` slice), plus the filter split's exchanges (an all-gather of the full activation
  before each layer that needs all input channels in the forward pass, a reduce-scatter of the same
  size in the backward pass); a forward on a stage waits for the previous virtual stage's output
  plus one point-to-point transfer (``timed_makespan``, through ``parallel.pipeline.simulate.timeline``: the
  unit-time model of ``simulate`` with measured times in place of unit ticks).
* Data parallel: each stage's gradients (``params / fs``) are all-reduced over ``dp`` replicas in
  buckets (``planner.buckets``); only the part past the stage's last backward is exposed.
* ``--plan krizhevsky2014`` (Krizhevsky 2014, section 4): conv layers data parallel at ``B / N``
  per actor, the batch all-gathered before the first FC layer, FC layers filter-split over the same
  ``N`` actors at the whole batch ``B``; conv gradients all-reduced, overlapped with their backward.

The split: on the busiest stage, ``compute`` is its layers' time over all micro-batches,
``exchange`` its filter-split collectives, ``bubble`` the rest of the pipeline's makespan (idle
ticks and point-to-point waits), ``allreduce`` the exposed all-reduce after it. They add up to the
step time. Not modelled: the optimizer update, the loss, kernel-launch overheads that CUDA graphs
remove, the difference of compiled from eager layer times, and ``exchange_chunks`` (the overlapped
pieces of filter split's gathers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rayconv.layout import Layout
from rayconv.parallel import pipeline
from rayconv.planner.buckets import buckets, exposed_allreduce_ms
from rayconv.planner.links import Links
from rayconv.planner.memory import Precision, peak_gib
from rayconv.planner.profile import LayerTimes, Profile, chunks_of, stage_layers

BACKWARD_SHARE = 2.0 / 3.0  # backward / (forward + backward) of a layer


@dataclass
class Prediction:
    """A layout's predicted step: ``step_ms`` = ``compute_ms + exchange_ms + allreduce_ms + bubble_ms``
    (ms), ``images_per_s``, and ``peak_gib`` the largest predicted peak memory of any actor (GiB);
    ``stages``: the pipeline's layer ranges."""

    layout: Layout
    step_ms: float
    compute_ms: float
    exchange_ms: float
    allreduce_ms: float
    bubble_ms: float
    peak_gib: float
    images_per_s: float
    stages: list = field(default_factory=list)

    def settings(self) -> dict:
        """The Config fields the prediction is for (``exchange_chunks`` is not modelled: left out)."""
        return {k: v for k, v in self.layout.to_config_fields().items() if k != "exchange_chunks"}

    def as_dict(self) -> dict:
        return {"layout": self.layout.name, **self.settings(), "step_ms": self.step_ms,
                "images_per_s": self.images_per_s, "compute_ms": self.compute_ms,
                "exchange_ms": self.exchange_ms, "allreduce_ms": self.allreduce_ms,
                "bubble_ms": self.bubble_ms, "peak_gib": self.peak_gib,
                "stages": [list(s) for s in self.stages]}


def timed_makespan(sched: pipeline.Schedule, f_ms: Sequence[float], b_ms: Sequence[float],
                   link_ms: Sequence[float]) -> tuple[float, list[float], list[float]]:
    """Run ``sched``'s programs with measured times (``parallel.pipeline.timeline``): an action on virtual
    stage v (chunk c of stage s, v = c * P + s) takes ``f_ms[v]`` or ``b_ms[v]``, and starts when its stage is
    free and its input has arrived (the previous virtual stage's forward, or the next one's backward, plus
    ``link_ms[b]``: the transfer over the boundary b between virtual stages b and b + 1, ms).

    With every time 1 and links 0 the makespan is ``len`` of ``parallel.pipeline.simulate.simulate``'s grid
    rows. Returns (makespan ms, per stage the end of its last action, per stage its busy ms). Raises
    pipeline.ScheduleError on a deadlock."""
    rows = pipeline.timeline(sched, f_ms, b_ms, list(link_ms) or 0)
    free = [row[-1][1] if row else 0.0 for row in rows]
    busy = [sum(end - start for start, end in row) for row in rows]
    return max(free), free, busy


def predict(layout: Layout, profile: Profile, times: LayerTimes, links: Links, global_batch: int,
            precision: str = "fp32", bucket_mb: float = 25.0) -> Prediction:
    """The predicted step of ``layout`` at ``global_batch`` images. Raises ValueError for a layout
    the batch cannot be split for (the message says why)."""
    prec = Precision.of(precision)
    if layout.plan == "krizhevsky2014":
        return _predict_plan(layout, profile, times, links, global_batch, prec, bucket_mb)
    return _predict_mesh(layout, profile, times, links, global_batch, prec, bucket_mb)


@dataclass
class _Chunks:
    """Per virtual stage of a mesh layout: forward and backward ms (exchanges included), compute and
    exchange ms of one micro-batch, and the point-to-point ms to the next virtual stage."""

    f_ms: list = field(default_factory=list)
    b_ms: list = field(default_factory=list)
    compute: list = field(default_factory=list)
    exchange: list = field(default_factory=list)
    link: list = field(default_factory=list)


def _chunk_times(layout: Layout, prof: Profile, t: Sequence[float], links: Links, mb: int, prec: Precision,
                 chunks: Sequence[tuple[int, int]]) -> _Chunks:
    """``_Chunks`` of ``layout`` at micro-batch ``mb``, ``t`` one filter slice's per-layer ms."""
    pp, fs = layout.pp, layout.fs
    mesh = layout.mesh()
    fs_ranks, pp_ranks = mesh.groups("fs")[0], mesh.groups("pp")[0]
    gathers = set(prof.gathers) if fs > 1 else set()

    def gather_ms(layer_elems: int) -> float:
        return links.allgather_ms(layer_elems * mb * prec.act_bytes, fs_ranks)

    out = _Chunks()
    for v, (a, b) in enumerate(chunks):
        work = sum(t[a:b])
        ex = sum(gather_ms(prof.act_in(i)) for i in range(a, b) if i in gathers)
        if fs > 1 and v == len(chunks) - 1:  # the logits are gathered at the end
            ex += gather_ms(prof.out_elems[-1])
        out.compute.append(work)
        out.exchange.append(ex)
        out.f_ms.append(work * (1 - BACKWARD_SHARE) + ex)
        out.b_ms.append(work * BACKWARD_SHARE + ex)
        s, nxt = v % pp, (v + 1) % pp
        out.link.append(
            links.p2p_ms(prof.out_elems[b - 1] * mb * prec.act_bytes / fs, pp_ranks[s], pp_ranks[nxt])
            if v + 1 < len(chunks)
            else 0.0
        )
    return out


def _predict_mesh(layout: Layout, prof: Profile, times: LayerTimes, links: Links, B: int, prec: Precision,
                  bucket_mb: float) -> Prediction:
    dp, pp, fs, M, V = layout.dp, layout.pp, layout.fs, layout.num_microbatches_or_1, layout.virtual_stages
    if B % dp or (B // dp) % M:
        raise ValueError(f"global batch {B} does not split over dp {dp} x {M} micro-batches")
    mb = B // dp // M
    t = list(times(mb, fs))  # one filter slice's layers
    chunks = chunks_of(list(times(mb, 1)), pp * V)  # whole layers' times, as the run's --balance time cuts
    c = _chunk_times(layout, prof, t, links, mb, prec, chunks)
    makespan, ends, busy = timed_makespan(pipeline.make_schedule(layout.schedule, pp, M, V), c.f_ms, c.b_ms,
                                          c.link)
    # Data parallel: each stage's gradients, all-reduced as its last backward produces them.
    step = makespan
    back = [x * BACKWARD_SHARE for x in t]
    dp_ranks = layout.mesh().groups("dp")
    for s in range(pp):
        if dp > 1:
            layers = stage_layers(chunks, pp, s)
            sizes, ready = buckets(layers, [p / fs for p in prof.params], back, prec.param_bytes, bucket_mb)
            ranks = dp_ranks[s * fs]  # the dp group of stage s, filter slice 0
            step = max(step, ends[s] + exposed_allreduce_ms(sizes, ready, sum(back[i] for i in layers),
                                                            lambda n: links.allreduce_ms(n, ranks)))
    crit = max(range(pp), key=lambda s: busy[s])
    stage_v = list(range(crit, len(chunks), pp))
    compute = M * sum(c.compute[v] for v in stage_v)
    exchange = M * 2 * sum(c.exchange[v] for v in stage_v)
    peak = peak_gib(layout, prof, B, precision=prec, chunks=chunks)
    return Prediction(layout, step, compute, exchange, step - makespan, makespan - busy[crit], peak,
                      B / step * 1e3, stages=chunks)


def _predict_plan(layout: Layout, prof: Profile, times: LayerTimes, links: Links, B: int, prec: Precision,
                  bucket_mb: float) -> Prediction:
    N, k = layout.dp, prof.first_fc
    if k is None:
        raise ValueError("the per-layer plan needs fully connected layers")
    if B % N:
        raise ValueError(f"global batch {B} does not split over {N} actors")
    ranks = list(range(N))
    conv_t, fc_t = list(times(B // N, 1))[:k], list(times(B, N))[k:]
    compute = sum(conv_t) + sum(fc_t)
    # The batch gathered before the first FC layer (forward; reduce-scattered back), FC gathers, logits.
    gathers = (
        [prof.act_in(k) * B] + [prof.act_in(i) * B for i in prof.gathers if i > k] + [prof.out_elems[-1] * B]
    )
    exchange = 2 * sum(links.allgather_ms(n * prec.act_bytes, ranks) for n in gathers)
    back = [x * BACKWARD_SHARE for x in conv_t]
    sizes, ready = buckets(list(range(k)), prof.params, back, prec.param_bytes, bucket_mb)
    allreduce = exposed_allreduce_ms(sizes, ready, sum(back), lambda n: links.allreduce_ms(n, ranks))
    step = compute + exchange + allreduce
    peak = peak_gib(layout, prof, B, precision=prec)
    return Prediction(layout, step, compute, exchange, allreduce, 0.0, peak, B / step * 1e3,
                      stages=[(0, prof.num_layers)])


__all__ = ["Prediction", "predict", "timed_makespan", "BACKWARD_SHARE"]

"""A cost model of one synchronous SGD step for every layout rayconv runs: predicted step time,
its split (compute, exchange, all-reduce, bubble) and peak memory per actor.

Not to be confused with ``rayconv/parallel/plan.py``: that module builds the *routing plan* of one
given layout (layers, stages, schedule, the per-layer plan ``--plan krizhevsky2014``) which the
actors run. This module *predicts* what a layout costs, so that ``rayconv.layout_search`` (the
``python -m rayconv.plan`` command and ``--layout auto``) can rank layouts before any actor starts.
It runs no model and starts no actor: every input is measured elsewhere and passed in.

Inputs
------
* ``Profile``: per layer of ``models.to_layers`` the per-sample output elements and parameter
  count, the first fully connected layer, and the layers a filter split gathers before.
* ``LayerTimes``: forward + backward time (ms) of each layer at a given batch size, whole or as one
  actor's shard of a filter split over ``fs`` actors (its own exchanges left out), measured on the
  device (``parallel.plan.layer_times``). The backward is taken as 2/3 of it (the usual 1 : 2
  forward : backward ratio of convolutions and matrix products; Narayanan et al. 2021, section 3.3).
* ``Links``: latency and bandwidth of all-reduce, all-gather and point-to-point transfers inside
  a node and between nodes (measured between actors, or from ``LINK_TABLE``).

The step of a layout (Yadan et al. 2013, section 3; Huang et al. 2019; Narayanan et al. 2021)
----------------------------------------------------------------------------------------------
* Each pipeline stage (``pp``, times ``virtual_stages`` chunks) runs its schedule's program
  (``schedule.make_schedule``), each action taking its chunk's measured time at the micro-batch
  size (of the ``fs`` shard), plus the filter split's exchanges (an all-gather of the full activation
  before each layer that needs all input channels in the forward pass, a reduce-scatter of the same
  size in the backward pass); a forward on a stage waits for the previous virtual stage's output
  plus one point-to-point transfer (``timed_makespan``, through ``schedule.timeline``: the unit-time
  model of ``schedule.simulate`` with measured times in place of unit ticks).
* Data parallel: each stage's gradients (``params / fs``, in buckets formed in reverse layer order,
  the first 1 MB, then ``bucket_mb``, as ``parallel.data_parallel.GradientSync``) are all-reduced
  over ``dp`` replicas, each bucket as soon as the last micro-batch's backward has produced it and
  the previous bucket is done; only the part past the stage's last backward is exposed.
* ``--plan krizhevsky2014`` (Krizhevsky 2014, section 4): conv layers data parallel at ``B / N``
  per actor, the batch all-gathered before the first FC layer, FC layers filter-split over the same
  ``N`` actors at the whole batch ``B``; conv gradients all-reduced, overlapped with their backward.

The split: on the busiest stage, ``compute`` is its layers' time over all micro-batches,
``exchange`` its filter-split collectives, ``bubble`` the rest of the pipeline's makespan (idle
ticks and point-to-point waits), ``allreduce`` the exposed all-reduce after it. They add up to the
step time. Not modelled: the optimizer update, the loss, kernel-launch overheads that CUDA graphs
remove, and the difference of compiled from eager layer times.

Memory per actor (bytes, what ``torch.cuda.max_memory_allocated`` counts): parameters, gradients and
SGD momentum (3 x parameters x 4 bytes in fp32 and bf16 autocast, x 8 in fp64), the data-parallel
gradient buckets (1 x more when dp > 1), and the activations of the micro-batches in flight: what
each layer saves for its backward pass per sample (autograd's saved tensors) x samples in flight
(``schedule.peak_in_flight``: 1F1B at most ``P - s`` on stage s, GPipe all ``M``) x activation
bytes (2 in bf16), divided by ``fs``. Against peaks measured on an H200 (compiled, CUDA graphs, bf16)
it predicts 1.2-1.5x too much: ResNet-50 at 256 on one GPU 13.4 vs 10.4 GiB,
dp=2 7.0 vs 5.6, 1F1B pp=2 at 512 with 4 micro-batches 10.5 vs 7.0 on stage 0; AlexNet's per-layer
plan at 1024 1.7 vs 1.2. A limit it enforces errs on the safe side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from rayconv.parallel.pipeline import validate as schedule

GIB = 2**30
MB = 2**20
BACKWARD_SHARE = 2.0 / 3.0  # backward / (forward + backward) of a layer
FIRST_BUCKET_MB = 1.0  # as parallel.data_parallel.GradientSync


@dataclass(frozen=True)
class Layout:
    """One layout: a mesh ``dp x pp x fs`` or the per-layer plan over ``dp`` actors, with its pipeline
    schedule. ``name`` is the bench's layout name (``dp2``, ``pp2m4``, ``pp2m8-gpipe``, ``pp2m4v2``,
    ``plan2``, ``dp2xfs2``, ``1gpu``)."""

    dp: int = 1
    pp: int = 1
    fs: int = 1
    plan: str = "none"
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.fs

    @property
    def name(self) -> str:
        if self.plan != "none":
            return f"plan{self.dp}"
        parts = [f"dp{self.dp}"] if self.dp > 1 else []
        if self.pp > 1:
            parts.append(f"pp{self.pp}m{self.num_microbatches}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1
                                                                    else ""))
        if self.fs > 1:
            parts.append(f"fs{self.fs}")
        text = "x".join(parts) or "1gpu"
        return text + ("-gpipe" if self.pp > 1 and self.schedule == "gpipe" else "")

    def settings(self) -> dict:
        """The ``rayconv.run`` settings (Config fields) of this layout."""
        return {"dp": self.dp, "pp": self.pp, "fs": self.fs, "plan": self.plan,
                "num_microbatches": self.num_microbatches, "schedule": self.schedule,
                "virtual_stages": self.virtual_stages}


@dataclass(frozen=True)
class Profile:
    """Per-layer facts of a model (``models.to_layers`` order). ``out_elems[i]``: elements of layer
    i's output per sample; ``params[i]``: parameters of layer i; ``in_elems``: elements of one input
    sample; ``first_fc``: index of the first Linear layer (None without one); ``gathers``: layers
    before which a filter split all-gathers its input (the output of the layer before them);
    ``max_fs``: the largest filter split the model allows (1: none, e.g. ResNets); ``flops[i]``: forward
    FLOPs of layer i per sample (``parallel.plan.layer_profile``); ``saved_elems[i]``: elements layer i
    saves for its backward pass per sample (``layout_search.saved_elems``)."""

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


@dataclass(frozen=True)
class LinkSpeed:
    """One kind of transfer: time(ms) = ``latency_ms`` + bytes / (``gbps`` x 1e9) x 1e3, where for
    collectives over n actors the bytes are NCCL's bus bytes: all-reduce 2 (n - 1) / n x size,
    all-gather / reduce-scatter (n - 1) / n x the gathered size."""

    gbps: float
    latency_ms: float = 0.0

    def ms(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_ms + nbytes / (self.gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Links:
    """Transfer speeds of a machine: ``intra`` inside a node, ``inter`` between nodes (None: one
    node), ``gpus_per_node`` actors per node (ranks fill nodes in order, as the placement group packs
    them). ``source`` says where the figures come from (measured, or a datasheet)."""

    name: str
    allreduce: LinkSpeed
    allgather: LinkSpeed
    p2p: LinkSpeed
    gpus_per_node: int = 8
    inter: Optional[LinkSpeed] = None
    source: str = ""

    def _spans(self, ranks: Sequence[int]) -> bool:
        return len({r // self.gpus_per_node for r in ranks}) > 1

    def allreduce_ms(self, nbytes: float, ranks: Sequence[int]) -> float:
        n = len(ranks)
        if n < 2:
            return 0.0
        speed = self.inter if self.inter is not None and self._spans(ranks) else self.allreduce
        return speed.ms(2 * (n - 1) / n * nbytes)

    def allgather_ms(self, nbytes: float, ranks: Sequence[int]) -> float:
        n = len(ranks)
        if n < 2:
            return 0.0
        speed = self.inter if self.inter is not None and self._spans(ranks) else self.allgather
        return speed.ms((n - 1) / n * nbytes)

    def p2p_ms(self, nbytes: float, a: int, b: int) -> float:
        speed = self.inter if self.inter is not None and self._spans([a, b]) else self.p2p
        return speed.ms(nbytes)


LayerTimes = Callable[[int, int], Sequence[float]]  # (batch size, fs) -> forward+backward ms per layer


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

    def as_dict(self) -> dict:
        return {"layout": self.layout.name, **self.layout.settings(), "step_ms": self.step_ms,
                "images_per_s": self.images_per_s, "compute_ms": self.compute_ms, "exchange_ms": self.exchange_ms,
                "allreduce_ms": self.allreduce_ms, "bubble_ms": self.bubble_ms, "peak_gib": self.peak_gib,
                "stages": [list(s) for s in self.stages]}


def balance(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges minimising the largest sum: ``parallel.pipeline.balance``'s
    rule (imported lazily: that module imports torch)."""
    from rayconv.parallel.pipeline.runner import balance as _balance

    return _balance(costs, num_stages)


def timed_makespan(sched: schedule.Schedule, f_ms: Sequence[float], b_ms: Sequence[float],
                   link_ms: Sequence[float]) -> tuple[float, list[float], list[float]]:
    """Run ``sched``'s programs with measured times (``schedule.timeline``): an action on virtual stage
    v (chunk c of stage s, v = c * P + s) takes ``f_ms[v]`` or ``b_ms[v]``, and starts when its stage
    is free and its input has arrived (the previous virtual stage's forward, or the next one's
    backward, plus ``link_ms[b]``: the transfer over the boundary b between virtual stages b and b + 1, ms).

    With every time 1 and links 0 the makespan is ``len`` of ``schedule.simulate``'s grid rows.
    Returns (makespan ms, per stage the end of its last action, per stage its busy ms).
    Raises schedule.ScheduleError on a deadlock."""
    rows = schedule.timeline(sched, f_ms, b_ms, list(link_ms) or 0)
    free = [row[-1][1] if row else 0.0 for row in rows]
    busy = [sum(end - start for start, end in row) for row in rows]
    return max(free), free, busy


def exposed_allreduce_ms(bucket_bytes: Sequence[float], ready_ms: Sequence[float], end_ms: float,
                         allreduce: Callable[[float], float]) -> float:
    """Time (ms) the all-reduce of gradient buckets runs past ``end_ms`` (the end of the backward
    pass): bucket k is ready at ``ready_ms[k]`` and its all-reduce (``allreduce(bytes)`` ms) starts
    when it is ready and bucket k - 1's is done (one collective stream, launched in order)."""
    t = 0.0
    for nbytes, ready in zip(bucket_bytes, ready_ms):
        t = max(t, ready) + allreduce(nbytes)
    return max(0.0, t - end_ms)


def buckets(layers: Sequence[int], params: Sequence[float], back_ms: Sequence[float], param_bytes: int,
            bucket_mb: float) -> tuple[list[float], list[float]]:
    """Gradient buckets of ``layers`` (layer indices in forward order) in backward order: (bytes,
    ready time in ms from the start of that backward pass), ``params[i]`` parameters and ``back_ms[i]``
    backward ms of layer i. The first bucket holds up to 1 MB, the others up to ``bucket_mb`` MB."""
    sizes, ready = [], []
    cur, t = 0.0, 0.0
    for i in reversed(layers):
        t += back_ms[i]
        nbytes = params[i] * param_bytes
        if nbytes == 0:
            continue
        limit = (FIRST_BUCKET_MB if not sizes else bucket_mb) * MB
        if cur and cur + nbytes > limit:
            sizes.append(cur)
            ready.append(last)
            cur = 0.0
        cur += nbytes
        last = t
    if cur:
        sizes.append(cur)
        ready.append(last)
    return sizes, ready


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter (and gradient, momentum) and per activation element."""

    param_bytes: int
    act_bytes: int

    @staticmethod
    def of(precision: str) -> "Precision":
        return {"fp32": Precision(4, 4), "bf16": Precision(4, 2), "fp64": Precision(8, 8)}[precision]


def static_bytes(params: float, dp: int, prec: Precision) -> float:
    """Parameters, gradients and momentum (and the data-parallel buckets when dp > 1), bytes."""
    return params * prec.param_bytes * (4 if dp > 1 else 3)


def predict(layout: Layout, profile: Profile, times: LayerTimes, links: Links, global_batch: int,
            precision: str = "fp32", bucket_mb: float = 25.0) -> Prediction:
    """The predicted step of ``layout`` at ``global_batch`` images. Raises ValueError for a layout
    the batch cannot be split for (the message says why)."""
    prec = Precision.of(precision)
    if layout.plan == "krizhevsky2014":
        return _predict_plan(layout, profile, times, links, global_batch, prec, bucket_mb)
    return _predict_mesh(layout, profile, times, links, global_batch, prec, bucket_mb)


def _mesh_ranks(layout: Layout):
    from rayconv.mesh import Mesh

    return Mesh(layout.dp, layout.pp, layout.fs)


def _predict_mesh(layout: Layout, prof: Profile, times: LayerTimes, links: Links, B: int, prec: Precision,
                  bucket_mb: float) -> Prediction:
    dp, pp, fs, M, V = layout.dp, layout.pp, layout.fs, layout.num_microbatches, layout.virtual_stages
    if B % dp or (B // dp) % M:
        raise ValueError(f"global batch {B} does not split over dp {dp} x {M} micro-batches")
    mb = B // dp // M
    t = list(times(mb, fs))  # one filter shard's layers
    # The cut balances whole layers' times, as the run's --balance time does.
    chunks = balance(list(times(mb, 1)), pp * V) if pp * V > 1 else [(0, prof.num_layers)]
    sched = schedule.make_schedule(layout.schedule, pp, M, V)
    mesh = _mesh_ranks(layout)
    fs_ranks, pp_ranks, dp_ranks = mesh.groups("fs")[0], mesh.groups("pp")[0], mesh.groups("dp")
    gathers = set(prof.gathers) if fs > 1 else set()

    def gather_ms(layer_elems: int) -> float:
        return links.allgather_ms(layer_elems * mb * prec.act_bytes, fs_ranks)

    f_ms, b_ms, comp, exch, link = [], [], [], [], []
    for v, (a, b) in enumerate(chunks):
        work = sum(t[a:b])
        ex = sum(gather_ms(prof.act_in(i)) for i in range(a, b) if i in gathers)
        if fs > 1 and v == len(chunks) - 1:  # the logits are gathered at the end
            ex += gather_ms(prof.out_elems[-1])
        comp.append(work)
        exch.append(ex)
        f_ms.append(work * (1 - BACKWARD_SHARE) + ex)
        b_ms.append(work * BACKWARD_SHARE + ex)
        s = v % pp
        nxt = (v + 1) % pp
        link.append(links.p2p_ms(prof.out_elems[b - 1] * mb * prec.act_bytes / fs, pp_ranks[s], pp_ranks[nxt])
                    if v + 1 < len(chunks) else 0.0)
    makespan, ends, busy = timed_makespan(sched, f_ms, b_ms, link)
    # Data parallel: each stage's gradients, all-reduced as its last backward produces them.
    step = makespan
    back = [x * BACKWARD_SHARE for x in t]
    for s in range(pp):
        layers = [i for v in range(s, len(chunks), pp) for i in range(*chunks[v])]
        if dp > 1:
            sizes, ready = buckets(layers, [p / fs for p in prof.params], back, prec.param_bytes, bucket_mb)
            last_b = sum(back[i] for i in layers)
            ranks = dp_ranks[s * fs]  # the dp group of stage s, filter shard 0
            step = max(step, ends[s] + exposed_allreduce_ms(sizes, ready, last_b,
                                                            lambda n: links.allreduce_ms(n, ranks)))
    crit = max(range(pp), key=lambda s: busy[s])
    stage_v = list(range(crit, len(chunks), pp))
    compute = M * sum(comp[v] for v in stage_v)
    exchange = M * 2 * sum(exch[v] for v in stage_v)
    peak = peak_gib(layout, prof, B, precision=prec, chunks=chunks)
    return Prediction(layout, step, compute, exchange, step - makespan, makespan - busy[crit], peak,
                      B / step * 1e3, stages=chunks)


def peak_gib(layout: Layout, prof: Profile, global_batch: int, precision="fp32",
             chunks: Optional[Sequence[tuple[int, int]]] = None) -> float:
    """Predicted peak memory (GiB) of the fullest actor of ``layout`` (see the module's memory model).
    ``chunks``: the pipeline's [start, end) layer ranges per virtual stage; default the cut by
    forward FLOPs (plus parameters), as ``parallel.plan.make_plan`` cuts without measured times.
    ``precision``: "fp32", "bf16", "fp64" or a ``Precision``."""
    prec = precision if isinstance(precision, Precision) else Precision.of(precision)
    if layout.plan != "none":
        N, k = layout.dp, prof.first_fc or 0
        acts = prof.saved(range(k)) * (global_batch // N) + prof.saved(range(k, prof.num_layers)) * global_batch / N \
            + prof.act_in(k) * global_batch  # (the gathered batch)
        return (static_bytes(sum(prof.params[:k]), N, prec) + static_bytes(sum(prof.params[k:]) / N, 1, prec)
                + acts * prec.act_bytes) / GIB
    pp, V = layout.pp, layout.virtual_stages
    if chunks is None:
        costs = [f + p for f, p in zip(prof.flops or [0.0] * prof.num_layers, prof.params)]
        chunks = balance(costs, pp * V) if pp * V > 1 else [(0, prof.num_layers)]
    mb = global_batch // layout.dp // layout.num_microbatches
    in_flight = schedule.peak_in_flight(schedule.make_schedule(layout.schedule, pp, layout.num_microbatches, V))
    worst = 0.0
    for s in range(pp):
        layers = [i for v in range(s, len(chunks), pp) for i in range(*chunks[v])]
        params = sum(prof.params[i] for i in layers) / layout.fs
        acts = prof.saved(layers) / layout.fs
        worst = max(worst, static_bytes(params, layout.dp, prec) + acts * mb * in_flight[s] * prec.act_bytes)
    return worst / GIB


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
    gathers = [prof.act_in(k) * B] + [prof.act_in(i) * B for i in prof.gathers if i > k] + [prof.out_elems[-1] * B]
    exchange = 2 * sum(links.allgather_ms(n * prec.act_bytes, ranks) for n in gathers)
    back = [x * BACKWARD_SHARE for x in conv_t]
    sizes, ready = buckets(list(range(k)), prof.params, back, prec.param_bytes, bucket_mb)
    allreduce = exposed_allreduce_ms(sizes, ready, sum(back), lambda n: links.allreduce_ms(n, ranks))
    step = compute + exchange + allreduce
    peak = peak_gib(layout, prof, B, precision=prec)
    return Prediction(layout, step, compute, exchange, allreduce, 0.0, peak, B / step * 1e3,
                      stages=[(0, prof.num_layers)])


__all__ = ["Layout", "Profile", "LinkSpeed", "Links", "Prediction", "Precision", "predict", "timed_makespan",
           "exposed_allreduce_ms", "buckets", "static_bytes", "peak_gib"]

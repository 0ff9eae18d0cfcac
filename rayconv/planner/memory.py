"""The cost model's peak memory per actor, in bytes as ``torch.cuda.max_memory_allocated`` counts them.

Per actor: parameters, gradients and SGD momentum (3 x parameters x 4 bytes in fp32 and bf16
autocast, x 8 in fp64), the data-parallel gradient buckets (1 x more when dp > 1), and the
activations of the micro-batches in flight: what each layer saves for its backward pass per sample
(autograd's saved tensors) x samples in flight (``parallel.pipeline.peak_in_flight``: 1F1B at most ``P - s``
on stage s, GPipe all ``M``) x activation bytes (2 in bf16), divided by ``fs``. The per-layer plan
keeps the conv layers' activations of ``B / N`` samples, the FC layers' of ``B`` samples over ``N``
slices, and the gathered batch. Measured peaks come out lower than predicted (benchmarks/RESULTS.md),
so a limit it enforces errs on the safe side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from rayconv.layout import Layout
from rayconv.parallel import pipeline
from rayconv.planner.profile import Profile, chunks_of, stage_layers

GIB = 2**30


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter (and gradient, momentum) and per activation element."""

    param_bytes: int
    act_bytes: int

    @staticmethod
    def of(precision: Union[str, "Precision"]) -> "Precision":
        """``Precision`` of "fp32", "bf16" or "fp64" (a Precision is returned as it is)."""
        if isinstance(precision, Precision):
            return precision
        return {"fp32": Precision(4, 4), "bf16": Precision(4, 2), "fp64": Precision(8, 8)}[precision]


def static_bytes(params: float, dp: int, prec: Precision) -> float:
    """Parameters, gradients and momentum (and the data-parallel buckets when dp > 1), bytes."""
    return params * prec.param_bytes * (4 if dp > 1 else 3)


def peak_gib(layout: Layout, prof: Profile, global_batch: int, precision: Union[str, Precision] = "fp32",
             chunks: Optional[Sequence[tuple[int, int]]] = None) -> float:
    """Predicted peak memory (GiB) of the fullest actor of ``layout`` (see the module's model).
    ``chunks``: the pipeline's [start, end) layer ranges per virtual stage; default the cut by
    forward FLOPs (plus parameters), as ``parallel.routing.make_routing`` cuts without measured
    times. ``precision``: "fp32", "bf16", "fp64" or a ``Precision``."""
    prec = Precision.of(precision)
    if layout.plan != "none":
        return _plan_peak_bytes(layout.dp, prof, global_batch, prec) / GIB
    pp, V = layout.pp, layout.virtual_stages
    if chunks is None:
        chunks = chunks_of([f + p for f, p in zip(prof.flops or [0.0] * prof.num_layers, prof.params)],
                           pp * V)
    mb = global_batch // layout.dp // layout.num_microbatches_or_1
    in_flight = pipeline.peak_in_flight(pipeline.make_schedule(layout.schedule, pp,
                                                               layout.num_microbatches_or_1, V))
    worst = 0.0
    for s in range(pp):
        layers = stage_layers(chunks, pp, s)
        params = sum(prof.params[i] for i in layers) / layout.fs
        acts = prof.saved(layers) / layout.fs
        worst = max(worst, static_bytes(params, layout.dp, prec) + acts * mb * in_flight[s] * prec.act_bytes)
    return worst / GIB


def _plan_peak_bytes(N: int, prof: Profile, global_batch: int, prec: Precision) -> float:
    """Peak bytes of one actor of the per-layer plan over ``N`` actors."""
    k = prof.first_fc or 0
    acts = (
        prof.saved(range(k)) * (global_batch // N)
        + prof.saved(range(k, prof.num_layers)) * global_batch / N
        + prof.act_in(k) * global_batch
    )  # (the gathered batch)
    return (static_bytes(sum(prof.params[:k]), N, prec) + static_bytes(sum(prof.params[k:]) / N, 1, prec)
            + acts * prec.act_bytes)


def gpu_share_problem(need_gib: float, share: float, gpu_gib: float) -> Optional[str]:
    """What is wrong with an actor whose predicted peak is ``need_gib`` GiB taking ``share``
    (``--gpus-per-actor``) of a GPU of ``gpu_gib`` GiB, the share's memory being ``share x gpu_gib`` (None
    when it fits): actors packed onto one GPU each need their own memory, which Ray's fractional GPUs do not
    reserve."""
    if need_gib <= share * gpu_gib:
        return None
    return (
        f"--gpus-per-actor {share:g} gives each actor {share * gpu_gib:.3g} GiB of its {gpu_gib:.3g} GiB GPU,"
        f" but the layout's predicted peak is {need_gib:.3g} GiB per actor (parameters, gradients, momentum,"
        f" activations): raise --gpus-per-actor to at least {min(1.0, need_gib / gpu_gib):.2g}, lower"
        " --global-batch-size, or spread the model (--pp/--fs)"
    )


__all__ = ["GIB", "Precision", "static_bytes", "peak_gib", "gpu_share_problem"]

"""The data-parallel gradient buckets in the cost model: which bytes are all-reduced when, and how much
of that all-reduce a step waits for after its backward pass.

Gradients are bucketed in reverse layer order as ``parallel.data_parallel.GradientSync`` buckets
them (the first bucket up to 1 MB, the others up to ``bucket_mb``); each bucket's all-reduce starts
when its last gradient is ready and the previous bucket's is done (one collective stream).
"""

from __future__ import annotations

from typing import Callable, Sequence

MB = 2**20
FIRST_BUCKET_MB = 1.0  # as parallel.data_parallel.GradientSync


def buckets(layers: Sequence[int], params: Sequence[float], back_ms: Sequence[float], param_bytes: int,
            bucket_mb: float) -> tuple[list[float], list[float]]:
    """Gradient buckets of ``layers`` (layer indices in forward order) in backward order: (bytes,
    ready time in ms from the start of that backward pass), ``params[i]`` parameters and ``back_ms[i]``
    backward ms of layer i. The first bucket holds up to 1 MB, the others up to ``bucket_mb`` MB."""
    sizes, ready = [], []
    cur, t, last = 0.0, 0.0, 0.0
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


def exposed_allreduce_ms(bucket_bytes: Sequence[float], ready_ms: Sequence[float], end_ms: float,
                         allreduce: Callable[[float], float]) -> float:
    """Time (ms) the all-reduce of gradient buckets runs past ``end_ms`` (the end of the backward
    pass): bucket k is ready at ``ready_ms[k]`` and its all-reduce (``allreduce(bytes)`` ms) starts
    when it is ready and bucket k - 1's is done (one collective stream, launched in order)."""
    t = 0.0
    for nbytes, ready in zip(bucket_bytes, ready_ms):
        t = max(t, ready) + allreduce(nbytes)
    return max(0.0, t - end_ms)


__all__ = ["MB", "FIRST_BUCKET_MB", "buckets", "exposed_allreduce_ms"]

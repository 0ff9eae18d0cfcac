"""Compiled stage times of a two-stage pipeline cut, on one GPU, and the 1F1B step they predict.

    timeout 500 python benchmarks/stage_times.py --model resnet50 --batch 512 --microbatches 4

What it answers: ``--balance time`` cuts stages by *eager* per-layer times
(``rayconv.planner.layer_timing.layer_times``), while a GPU run compiles each stage. For each candidate cut
``k`` (stage 0 = layers ``[0, k)``, stage 1 = ``[k, L)``) the two stages are compiled exactly as a
pipeline actor compiles them (``torch.compile(nn.Sequential(...), dynamic=False)``, bf16 autocast,
channels_last) and their forward and backward are timed separately at the micro-batch size, each
replayed from a CUDA graph as the pipeline's steps are, with CUDA events, after warm-up. Both stages
run on the same GPU here, one after the other.

With ``--bound`` it only times the whole model (each step replayed from a CUDA graph, as the pipeline
stages run) at the global batch and at each micro-batch size and
prints ``BOUND`` lines: the speedup a perfectly balanced 2-stage 1F1B pipeline with free transfers
could reach, ``whole(B) / ((M + 1) * whole(B / M) / 2)``.

Prints (one line each, ms per micro-batch unless said):

* ``WHOLE b=B ms img/s``: the whole model compiled at the global batch and at the micro-batch size
  (what one GPU does, and how much a smaller batch costs per image);
* ``EAGER_CUT``: the cut ``--balance time`` picks from eager per-layer times at the micro-batch size;
* ``CUT k F0 B0 F1 B1 pred_step_ms pred_speedup``: per cut, the compiled stage times and the 1F1B
  step they predict (``rayconv.parallel.pipeline.simulate.timeline``: each action starts when its stage is
  free and its input has arrived; transfers cost ``--link-ms``), as a speedup over ``WHOLE`` at the global
  batch.

The prediction leaves out what the real pipeline adds (the exchange's launch, the optimizer step of
each stage, the loss); it bounds what balancing alone can give.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from rayconv.models import build_model, to_layers
from rayconv.planner.layer_timing import layer_times
from rayconv.parallel.pipeline.stages import balance
from rayconv.parallel.pipeline import make_schedule, timeline


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def as_graph(fn):
    """``fn`` captured once as a CUDA graph (after warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


DEV = torch.device("cuda")
SHAPE = (3, 224, 224)
AMP = dict(device_type="cuda", dtype=torch.bfloat16)


def parse_flags() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=512, help="global batch size (images)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--cuts", default="",
                   help="comma-separated cuts k to time (default: the eager cut, then +-1, +-2)")
    p.add_argument("--link-ms", type=float, default=0.3, help="one activation or gradient transfer (ms)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--bound", action="store_true",
        help="only time the whole model at the global batch and its micro-batch sizes (M = 2..16) and "
        "print the speedup bound of a balanced pp=2 1F1B pipeline with free transfers")
    return p.parse_args()


def time_whole(model_name: str, b: int, reps: int, graphed: bool = False) -> float:
    """ms of one compiled forward + backward of the whole model at batch ``b`` (replayed from a CUDA
    graph with ``graphed``)."""
    model = build_model(model_name, 1000, 3, 224).to(DEV).to(memory_format=torch.channels_last)
    cm = torch.compile(model, dynamic=False)
    x = torch.randn(b, *SHAPE, device=DEV).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (b,), device=DEV)

    def step():
        with torch.autocast(**AMP):
            loss = nn.functional.cross_entropy(cm(x).float(), y)
        loss.backward()
    return timed(as_graph(step) if graphed else step, reps)


def print_bound(a: argparse.Namespace) -> None:
    """The ``--bound`` lines: ``WHOLE_GRAPHED`` per batch size, then ``BOUND`` per global batch and M."""
    # The bound of a perfectly balanced two-stage 1F1B pipeline with free transfers: each stage does
    # half of the whole model's work on a micro-batch, and the step takes (M + P - 1) of those.
    # Steps replay a CUDA graph, as rayconv's pipeline stages do: without one, a compiled ResNet-50's
    # forward + backward costs the CPU about 18 ms, which hides the GPU time of small batches.
    sizes = sorted({a.batch // m for m in (1, 2, 4, 8, 16) if a.batch % m == 0 and a.batch // m >= 32})
    ms = {b: time_whole(a.model, b, a.reps, graphed=True) for b in sizes}
    for b in sizes:
        print(f"WHOLE_GRAPHED b={b} {ms[b]:.2f} ms {b / ms[b] * 1e3:.0f} img/s", flush=True)
    for g in sizes:
        for b in sizes:
            m = g // b
            if g < 256 or m < 2:
                continue
            bound = ms[g] / ((m + 1) * ms[b] / 2)
            print(f"BOUND global {g} M={m} micro-batch {b}: pp=2 1F1B at most {bound:.3f}x one GPU "
                  f"(micro-batch efficiency {ms[g] / g / (ms[b] / b):.3f}, bubble {1 / (m + 1):.3f})",
                  flush=True)


def print_eager_cut(model_name: str, mb: int) -> tuple[int, int]:
    """The cut ``--balance time`` picks from eager per-layer times at micro-batch ``mb`` (printed as
    ``EAGER_CUT``), and the number of layers."""
    layers = to_layers(build_model(model_name, 1000, 3, 224))
    eager = layer_times(layers, SHAPE, mb, DEV, torch.bfloat16)
    eager_cut = balance(eager, 2)[1][0]
    print(f"EAGER_CUT k={eager_cut} stage ms {sum(eager[:eager_cut]):.2f} / {sum(eager[eager_cut:]):.2f} "
          f"(eager per-layer sums, micro-batch {mb})", flush=True)
    return eager_cut, len(layers)


def time_stage(part: nn.Module, x: torch.Tensor, first: bool, y: torch.Tensor,
               reps: int) -> tuple[float, float, torch.Tensor]:
    """One stage compiled as a pipeline actor compiles it: (forward ms, backward ms, the input of the
    next stage), each timed from a CUDA graph; the last stage's backward starts from the loss."""
    part.to(DEV).to(memory_format=torch.channels_last)
    cp = torch.compile(part, dynamic=False)
    inp = x if first else x.detach().requires_grad_()

    def fwd():
        with torch.autocast(**AMP):
            return cp(inp)
    with torch.no_grad():  # (no autograd nodes on the default stream: they would break the capture)
        out = fwd()
    grad = torch.randn_like(out) if first else None
    f_ms = timed(as_graph(fwd), reps)

    def fb():
        o = fwd()
        if first:
            o.backward(grad)
        else:
            nn.functional.cross_entropy(o.float(), y).backward()
    b_ms = max(timed(as_graph(fb), reps) - f_ms, 0.0)
    with torch.no_grad(), torch.autocast(**AMP):
        x = cp(x).detach().contiguous(memory_format=torch.channels_last) if first else x
    part.to("cpu")
    return f_ms, b_ms, x


def time_cut(model_name: str, k: int, mb: int, reps: int) -> tuple[list[float], list[float], list]:
    """Forward and backward ms of both stages of cut ``k`` at micro-batch ``mb``, and the flat layers."""
    layers = to_layers(build_model(model_name, 1000, 3, 224))
    parts = [nn.Sequential(*[m for _, m in layers[:k]]), nn.Sequential(*[m for _, m in layers[k:]])]
    f_ms, b_ms = [], []
    x = torch.randn(mb, *SHAPE, device=DEV).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (mb,), device=DEV)
    for s, part in enumerate(parts):
        f, b, x = time_stage(part, x, s == 0, y, reps)
        f_ms.append(f)
        b_ms.append(b)
    return f_ms, b_ms, layers


def main() -> None:
    a = parse_flags()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    mb = a.batch // a.num_microbatches_or_1
    if a.bound:
        print_bound(a)
        return
    whole_ms = {}
    for b in (a.batch, mb):
        whole_ms[b] = time_whole(a.model, b, a.reps, graphed=True)
        print(f"WHOLE b={b} {whole_ms[b]:.2f} ms {b / whole_ms[b] * 1e3:.0f} img/s", flush=True)
    ref_ms = whole_ms[a.batch]

    eager_cut, n_layers = print_eager_cut(a.model, mb)
    cuts = [int(c) for c in a.cuts.split(",") if c] or [eager_cut + d for d in (0, -1, 1, -2, 2)
                                                           if 0 < eager_cut + d < n_layers]
    sched = make_schedule("1f1b", 2, a.num_microbatches_or_1)
    for k in cuts:
        f_ms, b_ms, layers = time_cut(a.model, k, mb, a.reps)
        pred = max(finish for row in timeline(sched, f_ms, b_ms, a.link_ms) for _, finish in row)
        print(
            f"CUT k={k} ({layers[k][0]}) F0 {f_ms[0]:.2f} B0 {b_ms[0]:.2f} F1 {f_ms[1]:.2f} B1 {b_ms[1]:.2f} "
            f"stage0 {f_ms[0] + b_ms[0]:.2f} stage1 {f_ms[1] + b_ms[1]:.2f} pred_step_ms {pred:.2f} "
            f"pred_speedup {ref_ms / pred:.3f}", flush=True)


if __name__ == "__main__":
    main()

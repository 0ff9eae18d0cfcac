"""Per-layer forward + backward time on one GPU, against the costs rayconv balances pipeline stages by.

    python benchmarks/layer_times.py --model resnet50 --batch 64,128 --stages 2

Prints ``LAYER i name ms flops_share`` per layer and ``CUT`` lines: the stage cut that balances the
measured times, and the one rayconv's plan picks, with each cut's largest stage time (ms).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from rayconv.config import Config
from rayconv.mesh import Mesh
from rayconv.models import build_model, to_layers
from rayconv.parallel.pipeline import balance
from rayconv.parallel.plan import make_plan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", default="64,128")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = build_model(a.model, 1000, 3, 224)
    layers = to_layers(model)
    cfg = Config(model=a.model, data="synthetic", num_classes=1000, pp=a.stages, dp=1,
                 num_microbatches=1, global_batch_size=64)
    plan = make_plan(cfg, Mesh(dp=1, pp=a.stages, fs=1), model, (3, 224, 224))
    model.to(dev).to(memory_format=torch.channels_last)
    for b in [int(v) for v in a.batch.split(",")]:
        x = torch.randn(b, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
        times = []
        for i, (name, m) in enumerate(layers):
            inp = x.detach().requires_grad_() * 1  # a non-leaf: layers may start with an in-place ReLU
            for r in range(a.reps + 3):
                if r == 3:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = m(inp if i > 0 else x)
                out.float().sum().backward() if out.requires_grad else None
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / a.reps * 1e3)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                x = m(x)
        total_f = sum(plan.flops)
        for i, ((name, _), t) in enumerate(zip(layers, times)):
            print(f"LAYER b={b} {i} {name} {t:.3f} ms flops_share {plan.flops[i] / total_f:.3f}")

        def worst(cut):
            return max(sum(times[s:e]) for s, e in cut)
        by_time = balance(times, a.stages)
        print(f"CUT b={b} by measured time {by_time}: largest stage {worst(by_time):.2f} ms of {sum(times):.2f}")
        print(f"CUT b={b} rayconv plan {list(plan.stages)}: largest stage {worst(plan.stages):.2f} ms")
        for s in range(1, len(layers)):
            print(f"CUTAT b={b} {s} stage0 {sum(times[:s]):.2f} stage1 {sum(times[s:]):.2f}")


if __name__ == "__main__":
    main()

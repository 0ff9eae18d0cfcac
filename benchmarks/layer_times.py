"""Per-layer forward + backward time on one device, and the pipeline cuts it gives against FLOPs.

    timeout 300 python benchmarks/layer_times.py --model resnet50 --batch 64,128 --stages 2

Prints ``LAYER b=B i name ms flops_share`` per layer (``rayconv.planner.layer_timing.layer_times``, what
``--balance time`` measures) and ``CUT`` lines: the cut balancing the measured times and the cut by
forward FLOPs (``--balance flops``), each with its largest stage time (ms).
"""

from __future__ import annotations

import argparse

import torch

from rayconv.config import Config
from rayconv.mesh import Mesh
from rayconv.models import build_model, to_layers
from rayconv.parallel.pipeline.stages import balance
from rayconv.parallel.routing import make_routing
from rayconv.planner.layer_timing import layer_times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", default="64,128")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    shape = (3, a.image_size, a.image_size)
    torch.manual_seed(0)
    model = build_model(a.model, 1000, 3, a.image_size)
    cfg = Config(model=a.model, data="synthetic", num_classes=1000, image_size=a.image_size, pp=a.stages, dp=1,
                 global_batch_size=64, balance="flops")
    routing = make_routing(cfg, Mesh(dp=1, pp=a.stages, fs=1), model, shape)
    layers = to_layers(model)
    total_f = sum(routing.flops)
    for b in [int(v) for v in a.batch.split(",")]:
        times = layer_times(layers, shape, b, dev, torch.bfloat16 if dev.type == "cuda" else None)
        for i, ((name, _), t) in enumerate(zip(layers, times)):
            print(f"LAYER b={b} {i} {name} {t:.3f} ms flops_share {routing.flops[i] / total_f:.3f}")

        def worst(cut) -> float:
            return max(sum(times[s:e]) for s, e in cut)

        by_time = balance(times, a.stages)
        print(f"CUT b={b} by measured time {by_time}: largest stage {worst(by_time):.2f} ms of {sum(times):.2f}")
        print(f"CUT b={b} by FLOPs {list(routing.stages)}: largest stage {worst(routing.stages):.2f} ms")


if __name__ == "__main__":
    main()

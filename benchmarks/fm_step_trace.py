"""rayconv's Fashion-MNIST step at 64 px (the README recipe, one GPU actor), measured by the bench's own
machinery (``rayconv.bench.measure``): images/s of the driver's loop and of the actor looping by itself,
the driver's idle time, the input stall, and a torch.profiler table of 20 steps of the actor (kernels by
GPU time: what bounds the step); the same for synthetic data of the same size. Starts a local Ray.

    python benchmarks/fm_step_trace.py OUT_DIR [DATA_DIR]   # on a GPU machine; tables in OUT_DIR/trace_*.txt
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray

from rayconv.bench.measure import measure
from rayconv.flags import parse_args

RECIPE = ("--model resnet18 --image-size 64 --epochs 30 --global-batch-size 512 --lr 0.4 --lr-warmup-epochs 2 "
          "--lr-warmup-decay 0.01 --label-smoothing 0.1 --weight-decay 5e-4 --norm-weight-decay 0 --random-erase 0.5 "
          "--opt sgd_nesterov --bias-weight-decay 0 --augment pad-crop --precision bf16 --compile off --device cuda")
SYNTHETIC = "--data synthetic --model resnet18 --image-size 64 --global-batch-size 512 --precision bf16 --compile off --device cuda"
COLUMNS = ("images_per_s", "step_ms_median", "in_actor_step_ms", "driver_overhead", "driver_idle_ms",
           "input_stall_ms", "first_step_s")


def main() -> None:
    out = Path(sys.argv[1])
    data_dir = sys.argv[2] if len(sys.argv) > 2 else "/usr/share/datasets/fashion-mnist"
    out.mkdir(parents=True, exist_ok=True)
    ray.init(include_dashboard=False)
    runs = {"fashion-mnist": f"--data fashion-mnist --data-dir {data_dir} {RECIPE}", "synthetic": SYNTHETIC}
    for name, flags in runs.items():
        row = measure(parse_args(flags.split()), warmup=5, steps=300, profile_steps=0, trace_steps=20,
                      trace_to=out / f"trace_{name}.txt")
        print(name, json.dumps({k: row.get(k) for k in COLUMNS}), flush=True)


if __name__ == "__main__":
    main()

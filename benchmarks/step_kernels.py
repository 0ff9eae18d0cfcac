"""Where a plain PyTorch training step's GPU time goes, and what cuDNN's algorithm timing changes:
torchvision resnet18 (10 classes), batch 512, S x S images, bf16 autocast, channels_last, Nesterov SGD
with weight decay (rayconv's captured update, ``actor.cuda_graph.sgd_step``), label smoothing 0.1.

Prints the first eager step's seconds, ms per step eager and replayed as one CUDA graph (images/s), and
with ``table`` the kernels of 5 eager steps by GPU time (torch.profiler).

    python benchmarks/step_kernels.py off 64 table     # cudnn.benchmark off, 64 px, with the table
    python benchmarks/step_kernels.py on 64            # cuDNN times its algorithms first
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch
import torchvision

from rayconv.actor.cuda_graph import sgd_step

BATCH = 512


def resnet18_step(size: int, dtype: torch.dtype = torch.float32) -> tuple[Callable[[], None], torch.Tensor]:
    """(one training step of resnet18 as this module's docstring gives it, on random labels; its images'
    buffer, (512, 3, S, S) of ``dtype``, channels_last, filled with random values: write a batch into it
    before a call)."""
    dev = torch.device("cuda")
    model = torchvision.models.resnet18(num_classes=10).to(dev).to(memory_format=torch.channels_last)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=0.1, momentum=0.9, nesterov=True)
    lr = {torch.float32: torch.tensor(0.1, device=dev)}
    x = torch.randn(BATCH, 3, size, size, device=dev).to(dtype).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (BATCH,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        sgd_step(opt, lr)
        opt.zero_grad(set_to_none=True)

    return step, x


def main() -> None:
    timing, size = sys.argv[1], int(sys.argv[2])
    tag = f"[cudnn.benchmark {timing}, {size} px]"
    torch.backends.cudnn.benchmark = timing == "on"
    step, _ = resnet18_step(size)
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # (warm-up on a side stream, as before a capture)
        for i in range(3):
            step()
            if i == 0:
                torch.cuda.synchronize()
                print(f"{tag} first eager step {time.perf_counter() - t0:.3f} s")
    torch.cuda.current_stream().wait_stream(side)
    print(f"{tag} eager {ms_per_call(step, 100):.3f} ms/step")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = ms_per_call(graph.replay, 300)
    print(f"{tag} CUDA graph {ms:.3f} ms/step = {BATCH / ms * 1e3:,.0f} images/s")
    if "table" in sys.argv[3:]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))


def ms_per_call(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


if __name__ == "__main__":
    main()

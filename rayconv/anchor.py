"""The anchors rayconv is measured against: plain PyTorch on one device, and torchrun DDP.

Same settings as rayconv's benchmark: synthetic ImageNet-shaped data made on the device, SGD with
momentum 0.9 and weight decay 5e-4, cross-entropy, channels_last, bf16 autocast (``--precision``).

    python -m rayconv.anchor --model resnet50 --batch 256                      # plain PyTorch, 1 GPU
    torchrun --nproc_per_node=2 -m rayconv.anchor --model resnet50 --batch 128 --ddp   # DDP, per-GPU batch

Prints one line ``RESULT {json}`` with images_per_s (all devices), step_ms, peak_gib (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn as nn

from .models import build_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rayconv.anchor", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256, help="images per device per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel under torchrun")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)

    rank, world = 0, 1
    if a.ddp:
        import torch.distributed as dist

        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cudnn.benchmark = True
    else:
        dev = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(a.model, a.num_classes, 3, a.image_size).to(dev)
    if dev.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    step_model = model
    if a.ddp:
        step_model = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if a.compile:  # around DDP, as PyTorch recommends: its graph is split at the buckets (DDPOptimizer)
        step_model = torch.compile(step_model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(a.batch, 3, a.image_size, a.image_size, device=dev)
    if dev.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, a.num_classes, (a.batch,), device=dev)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = loss_fn(step_model(x), y)
        loss.backward()
        opt.step()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    t0 = time.perf_counter()
    for _ in range(a.warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / a.steps
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    if rank == 0:
        print("RESULT " + json.dumps({
            "anchor": "torchrun DDP" if a.ddp else "plain PyTorch", "model": a.model, "world_size": world,
            "batch_per_device": a.batch, "global_batch_size": a.batch * world, "precision": a.precision,
            "compile": a.compile, "images_per_s": a.batch * world / dt, "step_ms": dt * 1e3, "peak_gib": peak,
            "warmup_s": warmup_s}), flush=True)
    if a.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

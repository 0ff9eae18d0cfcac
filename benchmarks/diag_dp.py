"""Data-parallel gradient sync without Ray: rayconv's GradientSync against DDP in the same processes.

    torchrun --nproc_per_node=2 benchmarks/diag_dp.py --model resnet50 --batch 128 [--compile]

Each variant trains the same model (bf16 autocast, channels_last, synthetic data) for --steps timed
steps after --warmup; rank 0 prints ``DIAG variant step_ms images_per_s``. Variants: ``ddp`` (torch
DDP; compiled as torch.compile(DDP(model)) with --compile), ``gradsync`` (rayconv.parallel
.data_parallel.GradientSync with the worker's buffer broadcast; compiled per segment as the worker
does), ``gradsync-nobuffers`` (no batch-norm buffer broadcast) and ``local`` (no communication: the
floor). Used to locate a gap between rayconv's dp and DDP: if gradsync matches ddp here, the gap is
in the actor path, not in the gradient sync.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from rayconv.models import build_model, to_layers
from rayconv.parallel.data_parallel import GradientSync, broadcast_modules
from rayconv.parallel.segments import compile_part


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--variants", default="ddp,gradsync,gradsync-nobuffers,local")
    p.add_argument("--rounds", type=int, default=1, help="repeat the variant list (interleaved, against drift)")
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    x = torch.randn(a.batch, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    group = dist.new_group(list(range(world)))

    for variant in a.variants.split(",") * a.rounds:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _, m in to_layers(build_model(a.model, 1000, 3, 224))])
        model = model.to(dev).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        sync = None
        if variant == "ddp":
            run = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index], process_group=group)
            run = torch.compile(run) if a.compile else run
        elif variant.startswith("gradsync"):
            sync = GradientSync(list(model.parameters()), group)
            run = compile_part(model, sync.bucket_bytes) if a.compile else model
        else:
            run = torch.compile(model) if a.compile else model

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = run(x)
            loss = nn.functional.cross_entropy(out.float(), y, reduction="sum") / (a.batch * world)
            if sync is not None:
                sync.arm()
            loss.backward()
            if sync is not None:
                sync.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if variant == "gradsync":
                broadcast_modules([model], 0, group, buffers_only=True)

        t0 = time.perf_counter()
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / a.steps
        if rank == 0:
            print(f"DIAG {variant}{'+compile' if a.compile else ''} step_ms {dt * 1e3:.2f} "
                  f"images_per_s {a.batch * world / dt:.0f} warmup_s {warm:.1f}", flush=True)
        del run, model, opt, sync
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

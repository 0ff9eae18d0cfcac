"""The anchors rayconv is measured against: plain PyTorch on one device, and torchrun DDP, each in
the fastest configuration a user would pick.

Same settings as rayconv's benchmark: synthetic ImageNet-shaped data made on the device, SGD with
momentum 0.9 and weight decay 5e-4, cross-entropy, channels_last, bf16 autocast (``--precision``).
Every candidate configuration (``--configs``) is timed in turn, in the same process, and the fastest
is the result:

* plain PyTorch: ``eager``; with ``--compile`` also ``compile`` (torch.compile's default mode) and
  ``compile reduce-overhead`` (its CUDA graphs); ``compile max-autotune-no-cudagraphs`` on request.
* DDP: ``ddp bucket 25MB`` (DDP's defaults) and ``ddp bucket 100MB gradient_as_bucket_view
  static_graph``; with ``--compile`` also ``compile(ddp) bucket 25MB`` (torch.compile around DDP,
  its graph split at the buckets), ``ddp(compile) bucket 25MB`` (DDP around the compiled model) and
  ``ddp(compile) bucket 100MB gradient_as_bucket_view static_graph``.

    # plain PyTorch, 1 GPU:
    python -m rayconv.bench.anchor --model resnet50 --batch 256 --compile
    # DDP, 2 GPUs, --batch per GPU:
    torchrun --nproc_per_node=2 -m rayconv.bench.anchor --model resnet50 --batch 128 --ddp --compile

Prints ``CANDIDATE {json}`` per configuration (images_per_s, or ``error``) and then ``RESULT {json}``:
the fastest one's images_per_s (all devices), step_ms, peak_gib (rank 0), ``config`` (its name) and
``candidates`` (every configuration's images/s, null where it failed). Exits 1 if none ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

import torch
import torch.nn as nn

from rayconv.models import build_model

# name -> (compile: None, "outer" (around DDP) or "inner" (DDP around it); torch.compile mode; DDP settings)
PLAIN = {
    "eager": (None, None, {}),
    "compile": ("inner", None, {}),
    "compile reduce-overhead": ("inner", "reduce-overhead", {}),
    "compile max-autotune-no-cudagraphs": ("inner", "max-autotune-no-cudagraphs", {}),
}
_BIG = {"bucket_cap_mb": 100, "gradient_as_bucket_view": True, "static_graph": True}
DDP = {
    "ddp bucket 25MB": (None, None, {"bucket_cap_mb": 25}),
    "ddp bucket 100MB gradient_as_bucket_view static_graph": (None, None, _BIG),
    "compile(ddp) bucket 25MB": ("outer", None, {"bucket_cap_mb": 25}),
    "ddp(compile) bucket 25MB": ("inner", None, {"bucket_cap_mb": 25}),
    "ddp(compile) bucket 100MB gradient_as_bucket_view static_graph": ("inner", None, _BIG),
}


def default_configs(ddp: bool, compiled: bool) -> list[str]:
    """The candidates timed unless ``--configs`` names others: eager ones, and compiled ones with
    ``compiled``."""
    if ddp:
        eager = ["ddp bucket 25MB", "ddp bucket 100MB gradient_as_bucket_view static_graph"]
        return eager + ([n for n in DDP if n not in eager] if compiled else [])
    return ["eager"] + (["compile", "compile reduce-overhead"] if compiled else [])


def pick_fastest(results: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The candidate with the most images/s (failed ones, without images_per_s, skipped); None if none ran."""
    ran = [r for r in results if r.get("images_per_s")]
    return max(ran, key=lambda r: r["images_per_s"]) if ran else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rayconv.bench.anchor", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256, help="images per device per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration first (compiling)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--compile", action="store_true", help="also time the torch.compile configurations")
    p.add_argument("--configs", default="auto",
                   help="comma-separated configurations to time, or auto (the list above for --ddp / plain, "
                        f"with --compile the compiled ones): plain {', '.join(PLAIN)}; DDP {', '.join(DDP)}")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel under torchrun")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    known = DDP if a.ddp else PLAIN
    names = default_configs(a.ddp, a.compile) if a.configs == "auto" else a.configs.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(
            f"--configs: unknown {unknown} for {'--ddp' if a.ddp else 'plain PyTorch'}; choose from"
            f" {list(known)}"
        )

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
    results = []
    for name in names:
        try:
            r = time_config(a, dev, world, name, *known[name])
        except Exception as e:  # noqa: BLE001 - e.g. out of memory, a compiler error: the next one runs
            r = {"config": name,
                 "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        finally:
            torch._dynamo.reset()
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            print("CANDIDATE " + json.dumps(r), flush=True)
        results.append(r)
    best = pick_fastest(results)
    if rank == 0 and best is not None:
        print("RESULT " + json.dumps({
            "anchor": "torchrun DDP" if a.ddp else "plain PyTorch", "model": a.model, "world_size": world,
            "batch_per_device": a.batch, "global_batch_size": a.batch * world, "precision": a.precision,
            **best, "compile": known[best["config"]][0] is not None,
            "candidates": {r["config"]: r.get("images_per_s") for r in results}}), flush=True)
    if a.ddp:
        torch.distributed.destroy_process_group()
    return 0 if best is not None else 1


def time_config(a, dev: torch.device, world: int, name: str, compile_where: Optional[str],
                mode: Optional[str], ddp_kw: dict[str, Any]) -> dict[str, Any]:
    """Build the model afresh, wrap it as ``name`` says, run ``a.warmup`` then ``a.steps`` timed steps.
    Returns {config, images_per_s (all devices), step_ms, warmup_s, peak_gib (CUDA, else None)}."""
    torch.manual_seed(0)
    model = build_model(a.model, a.num_classes, 3, a.image_size).to(dev)
    if dev.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
        torch.cuda.reset_peak_memory_stats(dev)
    step_model: nn.Module = model
    if compile_where == "inner":
        step_model = torch.compile(step_model, mode=mode)
    if a.ddp:
        step_model = nn.parallel.DistributedDataParallel(
            step_model, device_ids=[dev.index] if dev.type == "cuda" else None, **ddp_kw)
    if compile_where == "outer":  # its graph is split at DDP's buckets (DDPOptimizer)
        step_model = torch.compile(step_model, mode=mode)
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
    return {"config": name, "images_per_s": a.batch * world / dt, "step_ms": dt * 1e3, "warmup_s": warmup_s,
            "peak_gib": peak}


# ---------------------------------------------------------------------- run from the bench
def compiles(args) -> bool:
    """Whether the anchors also time their torch.compile configurations (the fastest of all counts): on
    GPUs unless ``--compile off`` (rayconv itself compiles as its ``--compile`` rule says)."""
    return args.compile == "on" or (args.compile == "auto" and args.device_kind == "cuda")


def run_anchor(model: str, devices: int, global_batch: int, args) -> Optional[dict[str, Any]]:
    """Plain PyTorch (devices == 1) or torchrun DDP (devices > 1) at the same global batch, in its
    fastest configuration: this module run as a subprocess (``python -m rayconv.bench.anchor``), which
    times each candidate (eager ones, and when the bench compiles also the torch.compile ones). The
    result's ``config`` names the winner and ``candidates`` gives every candidate's images/s (None
    where it failed). Past ``--anchor-timeout`` the fastest of the candidates timed so far counts.
    None if no candidate ran (its stderr printed)."""
    base = ["-m", "rayconv.bench.anchor", "--model", model, "--batch", str(global_batch // devices),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--precision", "bf16" if args.precision == "bf16" else "fp32",
            "--device", args.device_kind, "--image-size", str(args.image_size)]
    base += ["--compile"] if compiles(args) else []
    cmd = (
        [sys.executable, *base]
        if devices == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={devices}",
            *base,
            "--ddp",
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.anchor_timeout, env=env)
        stdout, stderr = out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = f"past --anchor-timeout {args.anchor_timeout:g} s"
    timed = []
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if line.startswith("CANDIDATE "):
            timed.append(json.loads(line[len("CANDIDATE "):]))
    best = pick_fastest(timed)
    if best is not None:  # cut short: the fastest of those timed
        return {**best, "candidates": {r["config"]: r.get("images_per_s") for r in timed}}
    print(f"anchor failed ({' '.join(cmd)}):\n{stderr[-2000:]}", file=sys.stderr)
    return None


if __name__ == "__main__":
    sys.exit(main())

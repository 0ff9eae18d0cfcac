"""NCCL all-reduce time between two GPUs, from torchrun processes and from Ray actors.

    timeout 120 torchrun --standalone --nproc_per_node=2 benchmarks/nccl_bw.py   # torchrun processes
    timeout 120 python benchmarks/nccl_bw.py --ray [--one-gpu-visible]           # two Ray GPU actors

Prints ``NCCL <how> <MB> MB <ms> ms <GB/s> algbw`` for 4 MB, 25 MB and 100 MB float32 all-reduces
(median of 10 after 3 warm-up), run while the GPUs are otherwise idle.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from typing import Optional


def measure(rank: int, world: int, master: Optional[str], how: str, backend: str = "nccl") -> list[str]:
    import torch
    import torch.distributed as dist

    # Under torchrun (master None) the rendezvous is torchrun's own store (env://): a tcp:// address
    # would wait for a store server that rank 0 does not start under torchrun's agent.
    dist.init_process_group(backend, init_method=None if master is None else f"tcp://{master}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    lines = []
    for mb in (4, 25, 100):
        t = torch.ones(mb * 2**20 // 4, device=dev)
        times = []
        for i in range(13):
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        ms = sorted(times)[len(times) // 2] * 1e3
        lines.append(f"NCCL {how} {mb} MB {ms:.3f} ms {mb / 1024 / (ms / 1e3):.1f} GB/s algbw")
    dist.destroy_process_group()
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ray", action="store_true")
    p.add_argument("--one-gpu-visible", action="store_true")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"), help="gloo: a CPU check of the plumbing")
    a = p.parse_args()
    if not a.ray:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        import torch

        if a.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        lines = measure(rank, world, None, "torchrun", a.backend)
        if rank == 0:
            print("\n".join(lines), flush=True)
        return
    import ray

    ray.init()
    env = {} if a.one_gpu_visible else {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}

    @ray.remote(num_gpus=1, runtime_env={"env_vars": env})
    def run(rank: int, master: str) -> list[str]:
        import torch

        ids = ray.get_gpu_ids()
        torch.cuda.set_device(int(ids[0]) if not a.one_gpu_visible else 0)
        return measure(rank, 2, master, "ray-one-visible" if a.one_gpu_visible else "ray-all-visible")

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    master = f"127.0.0.1:{port}"
    print("\n".join(ray.get([run.remote(r, master) for r in range(2)])[0]), flush=True)


if __name__ == "__main__":
    main()

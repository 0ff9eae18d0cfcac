"""Run by ``tests/gpu/test_gpu.py`` under torchrun on 2 GPUs: both ranks send 64 MB to each other and
receive at once (1F1B's steady state), eagerly and replayed from a CUDA graph, through
``comm.exchange``. With ``--unpaired`` the sends and receives are posted one by one instead (the
pattern ``comm.exchange`` replaced): on 2 x H200 with torch 2.11 that failed with a CUDA illegal
memory access."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from rayconv.parallel import comm


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    dev, peer = torch.device("cuda", rank), 1 - rank
    group = dist.new_group([0, 1])
    n = 64 * 2**20 // 4  # 64 MB of float32, far above NCCL's per-peer buffers (4 MB)
    x = torch.full((n,), float(rank + 1), device=dev)
    if "--unpaired" in sys.argv:
        w = dist.isend(x, peer, group=group)
        buf = torch.empty_like(x)
        dist.recv(buf, peer, group=group)
        w.wait()
        torch.cuda.synchronize(dev)
        print(f"UNPAIRED-DONE {rank}", flush=True)
        return
    (buf,), works = comm.exchange([(x, peer)], [((n,), torch.float32, peer)], dev, group)
    for w in works:
        w.wait()
    assert buf[0].item() == peer + 1 and buf[-1].item() == peer + 1, buf
    out = torch.empty_like(x)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.graph(graph, stream=stream):
        (got,), works = comm.exchange([(x, peer)], [((n,), torch.float32, peer)], dev, group)
        for w in works:
            w.wait()
        out.copy_(got)
    for k in (10, 20):
        x.fill_(k * (rank + 1))
        graph.replay()
        torch.cuda.synchronize(dev)
        assert out[0].item() == k * (peer + 1) and out[-1].item() == k * (peer + 1), (k, out)
    print(f"PAIRED-OK {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

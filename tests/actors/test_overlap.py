"""Filter split's overlapped exchange (``filter_split.overlapped_gather``) on a real gloo process group
of two processes: the same output and gradients as one blocking gather, float64, and piece i + 1's
all-gather is under way before the layer computes piece i."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rayconv.parallel import comm
from rayconv.parallel.filter_split.exchanges import ExchangeSpec, Gather, overlapped_gather

SIZES = [3, 2]  # input channels per actor (uneven: the gather pads and trims)


def _worker(rank: int, init_method: str, chunks: int, results) -> None:
    # Bytes launched when a pass waits for an exchange: forward all-gathers, backward reduce-scatters.
    waits: dict[str, list[int]] = {"forward": [], "backward": []}
    forward = [False]
    wait = comm.Pending.wait

    def observed_wait(self):
        if forward[0]:
            waits["forward"].append(comm.volume().get("all_gather", 0))
        else:
            waits["backward"].append(comm.volume().get("reduce_scatter", 0))
        return wait(self)

    comm.Pending.wait = observed_wait
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        full_x = torch.randn(7, sum(SIZES), 6, 6, dtype=torch.float64)
        conv = nn.Conv2d(sum(SIZES), 4, 3, padding=1).double()  # this actor's filters (same on both: fine)
        out_grad = torch.randn(7, 4, 6, 6, dtype=torch.float64)
        start = sum(SIZES[:rank])
        mine = full_x.narrow(1, start, SIZES[rank])

        def run(overlap: bool):
            x = mine.clone().requires_grad_()
            conv.zero_grad()
            comm.reset_volume()
            waits["forward"], waits["backward"] = [], []
            forward[0] = True
            if overlap:
                y = overlapped_gather(x, ExchangeSpec(1, SIZES, rank, dist.group.WORLD, chunks), conv)
            else:
                y = conv(Gather(1, SIZES, rank, dist.group.WORLD, split_consumer=True)(x))
            forward[0] = False
            y.backward(out_grad)
            return y.detach(), x.grad, conv.weight.grad.clone()

        y1, gx1, gw1 = run(False)
        y2, gx2, gw2 = run(True)
        results[rank] = {
            "y": (y1 - y2).abs().max().item(), "gx": (gx1 - gx2).abs().max().item(),
            "gw": (gw1 - gw2).abs().max().item(),
            "waits": dict(waits),
        }
    finally:
        dist.destroy_process_group()


def test_overlapped_gather_equals_one_gather_and_runs_ahead(tmp_path):
    # (a file rendezvous: a TCP port picked here could be taken by another process before rank 0 listens)
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(f"file://{tmp_path / 'rendezvous'}", 3, shared), nprocs=2, join=True)
        results = {rank: dict(shared[rank]) for rank in (0, 1)}
    for rank in (0, 1):
        r = results[rank]
        assert r["y"] < 1e-12 and r["gx"] < 1e-12 and r["gw"] < 1e-12, r
        # Pieces of 3, 2, 2 samples. Forward: piece 0 is waited for once piece 1 is launched too, and
        # so on. Backward, last piece first: piece 2's reduce-scatter is waited for once piece 1's is
        # launched too, and so on.
        pad = max(SIZES) * 36 * 8   # bytes one sample's (padded) channel slice sends
        grad = sum(SIZES) * 36 * 8  # bytes of one sample's partial input gradient
        assert r["waits"]["forward"] == [5 * pad, 7 * pad, 7 * pad], r["waits"]
        assert r["waits"]["backward"] == [4 * grad, 7 * grad, 7 * grad], r["waits"]

"""Pieces of the actor without Ray: the CUDA-graph step's SGD update equals torch.optim.SGD's; Ray GPU ids
map to torch device indices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rayconv.actor.cuda_graph import sgd_step
from rayconv.cluster.connect import visible_index


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_capturable_sgd_equals_torch_sgd(dtype):
    """The update a CUDA graph step replays (learning rate read from a device tensor) is torch.optim.SGD's,
    over several steps with momentum, weight decay and a changing learning rate."""
    torch.manual_seed(0)
    ref = [nn.Parameter(torch.randn(5, 3, dtype=dtype)), nn.Parameter(torch.randn(3, dtype=dtype))]
    mine = [nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=5e-4)
    opt_mine = torch.optim.SGD(mine, lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_t = {dtype: torch.tensor(0.0, dtype=dtype)}
    for step, lr in enumerate([0.1, 0.05, 0.02, 0.07]):
        grads = [torch.randn_like(p) for p in ref]
        for p, q, g in zip(ref, mine, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ref.param_groups[0]["lr"] = lr
        opt_ref.step()
        lr_t[dtype].fill_(lr)
        sgd_step(opt_mine, lr_t)
        for p, q in zip(ref, mine):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14)
            assert torch.equal(opt_mine.state[q]["momentum_buffer"], opt_ref.state[p]["momentum_buffer"])
    # Its state is torch.optim.SGD's: a checkpoint of one loads into the other.
    opt_ref.load_state_dict(opt_mine.state_dict())
    with pytest.raises(ValueError, match="SGD with"):  # dampening is not captured
        sgd_step(torch.optim.SGD(mine, lr=0.1, momentum=0.9, dampening=0.1), lr_t)


def test_visible_index_maps_ray_gpu_ids_to_torch_indices():
    assert visible_index("3", "") == 3                 # every GPU visible: ids are indices
    assert visible_index("3", "2,3") == 1              # node started with CUDA_VISIBLE_DEVICES=2,3
    assert visible_index(2, " 2 , 3") == 0
    assert visible_index("GPU-abc", "GPU-xyz,GPU-abc") == 1  # UUIDs as ids


def test_only_actors_with_nccl_peers_get_the_all_gpus_visible_environment():
    """``acquire.actors_env``: GPU actors of a mesh of two or more see every GPU of their node
    (``--all-gpus-visible``, an environment variable of their runtime environment); a mesh of one actor,
    CPU actors and ``--no-all-gpus-visible`` get no runtime environment, so Ray starts them in the worker
    processes it starts for the job ahead."""
    from rayconv.cluster.connect import ALL_GPUS_VISIBLE_ENV
    from rayconv.cluster.acquire import actors_env
    from rayconv.config import Config
    from rayconv.mesh import Mesh

    gpu = Config(device="cuda", model="resnet18").validate()
    assert actors_env(gpu, Mesh(dp=2)) == {"env_vars": ALL_GPUS_VISIBLE_ENV}
    assert actors_env(gpu, Mesh(pp=2)) == {"env_vars": ALL_GPUS_VISIBLE_ENV}
    assert actors_env(gpu, Mesh()) is None
    assert actors_env(Config(device="cuda", all_gpus_visible=False).validate(), Mesh(dp=2)) is None
    assert actors_env(Config(device="cpu").validate(), Mesh(dp=2)) is None

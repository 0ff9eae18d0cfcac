"""Single-process PyTorch references that every parallel layout must match."""

from __future__ import annotations

import torch
from torch import nn

from rayconv.config import Config
from rayconv.data import Sharding, make_source
from rayconv.driver import learning_rate
from rayconv.models import build_model


def reference_sgd(cfg: Config, steps: int) -> dict[str, torch.Tensor]:
    """Plain single-device SGD on the same global batches (mean cross-entropy), in float64."""
    source = make_source(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.num_classes, source.sample_shape[0], source.sample_shape[1]).double()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    sharding = Sharding(source.train_size, cfg.global_batch_size, dp=1, seed=cfg.seed)
    for step in range(steps):
        epoch, s = divmod(step, sharding.steps_per_epoch)
        idx = sharding.global_batch(epoch, s)
        x = source.images("train", idx, torch.device("cpu"), epoch).double()
        y = source.labels("train", idx)
        for g in opt.param_groups:
            g["lr"] = learning_rate(cfg, step, steps)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-10) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")

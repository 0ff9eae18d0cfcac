"""Single-process PyTorch references that every parallel layout must match."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from rayconv.config import Config
from rayconv.data.registry import make_source
from rayconv.data.source import Sharding
from rayconv.mesh import split_slices
from rayconv.driver.schedule import learning_rate
from rayconv.models import build_model
from rayconv.recipe.mix import draw_mix, mix_images, mix_targets


def sgd_config(tmp_path, name: str, **kw) -> Config:
    """The small float64 run the equality tests compare with single-device SGD: ``convnet`` on the
    digits, global batch 96, SGD with momentum and weight decay, on CPU, output in ``tmp_path/name``;
    ``kw`` (``steps`` and ``eval_every`` among them) overrides or adds settings."""
    base = dict(model="convnet", data="digits", dp=1, global_batch_size=96, lr=0.05, momentum=0.9,
                weight_decay=5e-4, precision="fp64", device="cpu", progress=False, out=str(tmp_path / name))
    base.update(kw)
    return Config(**base).validate()


def wait_until(proc, ready, what: str, timeout_s: float = 120, poll_s: float = 0.5) -> None:
    """Poll ``ready()`` until it holds, failing the test if ``proc`` (a subprocess.Popen) ends first
    (with its output) or ``timeout_s`` passes (``what`` did not happen in time)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        time.sleep(poll_s)


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


def reference_mix_sgd(cfg: Config, steps: int) -> dict[str, torch.Tensor]:
    """``reference_sgd`` with ``cfg``'s mixup/cutmix: each global batch mixed as a whole with the draw of
    (seed, step) (``recipe.mix``), images and one-hot targets alike, mean cross entropy on the soft
    targets, in float64."""
    source = make_source(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.num_classes, source.sample_shape[0], source.sample_shape[1]).double()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    sharding = Sharding(source.train_size, cfg.global_batch_size, dp=1, seed=cfg.seed)
    for step in range(steps):
        epoch, s = divmod(step, sharding.steps_per_epoch)
        idx = sharding.global_batch(epoch, s)
        draw = draw_mix(cfg.seed, step, len(idx), cfg.mixup_alpha, cfg.cutmix_alpha, tuple(source.sample_shape[1:]))
        x = source.images("train", idx, torch.device("cpu"), epoch).double()
        y = source.labels("train", idx)
        x = mix_images(draw, x, x[draw.partner])
        y = mix_targets(draw, y, y[draw.partner], source.num_classes, torch.float64)
        for g in opt.param_groups:
            g["lr"] = learning_rate(cfg, step, steps)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_microbatch_sgd(cfg: Config, steps: int) -> tuple[dict[str, torch.Tensor], float]:
    """Single-device float64 SGD over ``cfg``'s global batches, each replica's share run as
    ``cfg.num_microbatches`` micro-batches with gradient accumulation (loss: per-sample sum / global
    batch); batch-norm running statistics updated once per step from replica 0's whole share.
    Returns (state_dict, test loss in eval mode)."""
    source = make_source(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.num_classes, source.sample_shape[0], source.sample_shape[1]).double()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in bns}
    record = [False]
    for m in bns:
        m.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0].detach()) if record[0] else None)
    sharding = Sharding(source.train_size, cfg.global_batch_size, dp=cfg.dp, seed=cfg.seed)
    for step in range(steps):
        epoch, s = divmod(step, sharding.steps_per_epoch)
        replicas = [sharding.replica_batch(epoch, s, r)[0] for r in range(cfg.dp)]
        count = sum(len(r) for r in replicas)
        for g in opt.param_groups:
            g["lr"] = learning_rate(cfg, step, steps)
        opt.zero_grad()
        for m in bns:  # micro-batches normalised by their own statistics, tracking nothing
            m.track_running_stats = False
        for r, idx in enumerate(replicas):
            record[0] = r == 0
            for sl in split_slices(len(idx), cfg.num_microbatches):
                x = source.images("train", idx[sl], torch.device("cpu"), epoch).double()
                loss = nn.functional.cross_entropy(model(x), source.labels("train", idx[sl]), reduction="sum")
                (loss / count).backward()
        opt.step()
        with torch.no_grad():
            for m in bns:  # one update from replica 0's whole share: nn.BatchNorm on the concatenation
                m.track_running_stats = True
                m.train()(torch.cat(seen[m]))
                seen[m].clear()
    model.eval()
    idx = torch.arange(source.test_size).numpy()
    with torch.no_grad():
        logits = model(source.images("test", idx, torch.device("cpu")).double())
        test_loss = nn.functional.cross_entropy(logits, source.labels("test", idx), reduction="sum").item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, test_loss / source.test_size


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-10) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")

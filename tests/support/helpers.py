"""Single-process PyTorch references that every parallel layout must match."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn
from torch.nn.modules.batchnorm import _BatchNorm

from rayconv.config import Config
from rayconv.data.order import make_order
from rayconv.data.registry import make_source
from rayconv.data.source import Sharding
from rayconv.mesh import split_slices
from rayconv.driver.lr import learning_rate
from rayconv.models import build_model
from rayconv.recipe.mix import draw_mix, mix_images, mix_targets
from rayconv.recipe.optim import group_of, param_groups


def sgd_config(tmp_path, name: str, **kw) -> Config:
    """The small float64 run the equality tests compare with single-device SGD: ``convnet`` on the
    digits, global batch 96, SGD with momentum and weight decay, on CPU, output in ``tmp_path/name``;
    ``kw`` (``steps`` and ``eval_every`` among them) overrides or adds settings."""
    base = dict(model="convnet", data="digits", dp=1, global_batch_size=96, lr=0.05, momentum=0.9,
                weight_decay=5e-4, precision="fp64", device="cpu", progress=False, out=str(tmp_path / name))
    base.update(kw)
    return Config(**base).validate()


def checkpoint_config(out, *, steps: int, **kw) -> Config:
    """A dp2 convnet run on digits in float64 of ``steps`` steps, a checkpoint every 2 (all kept), ``out``
    its folder; ``kw`` overrides."""
    base = dict(model="convnet", data="digits", dp=2, global_batch_size=64, steps=steps, lr=0.05,
                precision="fp64", device="cpu", progress=False, eval_every=100, out=str(out),
                checkpoint_every=2, keep_checkpoints=0, loader_workers=0)
    base.update(kw)
    return Config(**base).validate()


def reference_source(cfg: Config):
    """``cfg``'s data source decoded in this process (no loader workers): a sample's pixels depend on
    (seed, epoch, index) alone, not on which process decodes it, and each unannounced batch of a loader
    with workers forks them anew from this large process (a second or more per batch)."""
    return make_source(dataclasses.replace(cfg, loader_workers=0))


def wait_until(proc, ready, what: str, timeout_s: float = 120, poll_s: float = 0.5) -> None:
    """Poll ``ready()`` until it holds, failing the test if ``proc`` (a subprocess.Popen) ends first
    (with its output) or ``timeout_s`` passes (``what`` did not happen in time)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        time.sleep(poll_s)


def reference_sgd(cfg: Config, steps: int, mix_batch=None) -> dict[str, torch.Tensor]:
    """Plain single-device SGD on the same global batches (mean cross-entropy), in float64.
    ``mix_batch(step, x, y) -> (x, y)`` changes each global batch before the step (``reference_mix_sgd``)."""
    source = reference_source(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.num_classes, source.sample_shape[0],
                        source.sample_shape[1]).double()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    sharding = Sharding(source.train_size, cfg.global_batch_size, seed=cfg.seed,
                        order=make_order(cfg, source), val_split=cfg.val_split)
    for step in range(steps):
        epoch, s = divmod(step, sharding.steps_per_epoch)
        idx = sharding.global_batch(epoch, s)
        x = source.images("train", idx, torch.device("cpu"), epoch).double()
        y = source.labels("train", idx)
        if mix_batch is not None:
            x, y = mix_batch(step, x, y)
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
    source = reference_source(cfg)

    def mix_batch(step, x, y):
        draw = draw_mix(cfg.seed, step, len(x), cfg.mixup_alpha, cfg.cutmix_alpha,
                        tuple(source.sample_shape[1:]))
        return (mix_images(draw, x, x[draw.partner]),
                mix_targets(draw, y, y[draw.partner], source.num_classes, torch.float64))

    return reference_sgd(cfg, steps, mix_batch)


def reference_microbatch_sgd(cfg: Config, steps: int) -> tuple[dict[str, torch.Tensor], float]:
    """Single-device float64 SGD over ``cfg``'s global batches, each replica's share run as
    ``cfg.num_microbatches`` micro-batches with gradient accumulation (loss: per-sample sum / global
    batch); batch-norm running statistics updated once per step from replica 0's whole share; with
    ``cfg``'s recipe (``reference_recipe_sgd``). Returns (state_dict, test loss in eval mode)."""
    source = reference_source(cfg)
    model, _ = _reference_run(cfg, steps, source)
    model.eval()
    idx = torch.arange(source.test_size).numpy()
    with torch.no_grad():
        logits = model(source.images("test", idx, torch.device("cpu")).double())
        test_loss = nn.functional.cross_entropy(logits, source.labels("test", idx), reduction="sum").item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, test_loss / source.test_size


def reference_recipe_sgd(cfg: Config,
                         steps: int) -> tuple[dict[str, torch.Tensor], Optional[dict[str, torch.Tensor]]]:
    """``reference_microbatch_sgd``'s training with torchvision's recipe written in plain torch: the
    optimizer ``cfg.opt`` (torch's SGD, Nesterov SGD, AdamW, or LARS as ``_reference_lars_``) over
    ``recipe.param_groups`` (no decay on norm layers or biases as asked), the learning rate of ``driver.lr``
    (warm-up), cross entropy with ``label_smoothing``, ``nn.utils.clip_grad_norm_`` on the whole model, and
    with --model-ema torch's ``AveragedModel`` updated as torchvision's train.py updates its
    ExponentialMovingAverage. Returns (state_dict, the average's state_dict or None)."""
    model, ema = _reference_run(cfg, steps, reference_source(cfg))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, None if ema is None else {k: v.detach().clone() for k, v in ema.module.state_dict().items()}


def _reference_run(cfg: Config, steps: int, source) -> tuple[nn.Module, Optional[AveragedModel]]:
    """The training loop of the micro-batch and recipe references (see their docstrings)."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.num_classes, source.sample_shape[0],
                        source.sample_shape[1]).double()
    opt = _reference_optimizer(cfg, model)
    sharding = Sharding(source.train_size, cfg.global_batch_size, seed=cfg.seed,
                        order=make_order(cfg, source))
    ema = _reference_ema(cfg, model, sharding.steps_per_epoch)
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    for m in bns:   # --bn-momentum: nn.BatchNorm's own update below at that momentum
        m.momentum = m.momentum if cfg.bn_momentum is None else cfg.bn_momentum
    seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in bns}
    record = [False]
    for m in bns:
        m.register_forward_pre_hook(
            lambda mod, args: seen[mod].append(args[0].detach()) if record[0] else None
        )
    for step in range(steps):
        epoch, s = divmod(step, sharding.steps_per_epoch)
        replicas = [sharding.replica_batch(epoch, s, r, cfg.dp)[0] for r in range(cfg.dp)]
        count = sum(len(r) for r in replicas)
        for g in opt.param_groups:
            g["lr"] = learning_rate(cfg, step, steps, sharding.steps_per_epoch)
        opt.zero_grad()
        for m in bns:  # micro-batches normalised by their own statistics, tracking nothing
            m.track_running_stats = False
        for r, idx in enumerate(replicas):
            record[0] = r == 0
            for sl in split_slices(len(idx), cfg.num_microbatches):
                x = source.images("train", idx[sl], torch.device("cpu"), epoch).double()
                loss = nn.functional.cross_entropy(model(x), source.labels("train", idx[sl]), reduction="sum",
                                                   label_smoothing=cfg.label_smoothing)
                (loss / count).backward()
        if cfg.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        if cfg.opt == "lars":
            _reference_lars_(cfg, model)
        opt.step()
        with torch.no_grad():
            for m in bns:  # one update from replica 0's whole share: nn.BatchNorm on the concatenation
                m.track_running_stats = True
                m.train()(torch.cat(seen[m]))
                seen[m].clear()
        if ema is not None and s % cfg.model_ema_steps == 0:  # train.py: batch i of the epoch
            ema.update_parameters(model)
            if epoch < cfg.lr_warmup_epochs:
                ema.n_averaged.fill_(0)
    return model, ema


def _reference_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.opt == "lars":  # plain momentum SGD; _reference_lars_ folds the layers' decay into their gradients
        wd, adapted = cfg.weight_decay, {id(p) for p in _lars_adapted(model)}
        nwd = wd if cfg.norm_weight_decay is None else cfg.norm_weight_decay
        bwd = wd if cfg.bias_weight_decay is None else cfg.bias_weight_decay
        where = group_of(model, 0.0, 0.0)
        decay = {n: 0.0 if id(p) in adapted else bwd if where[n] == "bias" else nwd
                 for n, p in model.named_parameters()}
        return torch.optim.SGD(
            [{"params": [p], "weight_decay": decay[n]} for n, p in model.named_parameters()],
            lr=cfg.lr,
            momentum=cfg.momentum,
        )
    groups = param_groups(model, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    if cfg.opt == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           nesterov=cfg.opt == "sgd_nesterov")


def _lars_adapted(model: nn.Module) -> list[nn.Parameter]:
    """The tensors LARS adapts: every parameter but norm layers' and those named ``bias``."""
    where = group_of(model, 0.0, 0.0)
    return [p for n, p in model.named_parameters() if where[n] == "other"]


@torch.no_grad()
def _reference_lars_(cfg: Config, model: nn.Module) -> None:
    """You et al. 2017, Algorithm 1, one whole tensor at a time: ``g <- eta ||w|| / (||g|| + wd ||w||) *
    (g + wd w)`` (ratio 1 where a norm is 0), ``wd`` the run's --weight-decay."""
    wd, eta = cfg.weight_decay, cfg.lars_trust_coefficient
    for p in _lars_adapted(model):
        w_norm, g_norm = float(p.norm()), float(p.grad.norm())
        ratio = eta * w_norm / (g_norm + wd * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
        p.grad = ratio * (p.grad + wd * p)


def _reference_ema(cfg: Config, model: nn.Module, steps_per_epoch: int) -> Optional[AveragedModel]:
    """torchvision's ExponentialMovingAverage (an AveragedModel over parameters and buffers), its
    decay adjusted as train.py does: ``1 - min(1, (1 - decay) * batch * model_ema_steps / epochs)``,
    the epochs those the run spans (``--steps`` rounded up to whole epochs)."""
    if not cfg.model_ema:
        return None
    epochs = -(-cfg.steps // steps_per_epoch) if cfg.steps else (cfg.epochs or 10)
    adjust = cfg.global_batch_size * cfg.model_ema_steps / epochs
    decay = 1.0 - min(1.0, (1.0 - cfg.model_ema_decay) * adjust)
    return AveragedModel(model, avg_fn=lambda avg, p, n: decay * avg + (1 - decay) * p, use_buffers=True)


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                      atol: float = 1e-10) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=0, atol=atol,
                                   msg=lambda m: f"{k}: {m}")


def slow_among(values, slow) -> list:
    """``values`` for ``pytest.mark.parametrize`` with those in ``slow`` marked ``slow`` (a tuple is
    one value per argument name)."""
    import pytest

    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow) if v in slow else v
            for v in values]


def recalibrated(cfg: Config, state: dict[str, torch.Tensor],
                 steps: range) -> tuple[dict[str, torch.Tensor], float, float]:
    """``state`` (the whole model's, float64) with its batch-norm statistics recomputed, as
    ``--precise-bn-batches`` claims, over dp replica 0's share of the global batches of ``steps``:
    ``torch.optim.swa_utils.update_bn`` itself without micro-batches, else its arithmetic on each share's
    concatenated micro-batches (each normalised by its own statistics in the forward pass);
    ``num_batches_tracked`` kept. Returns (state, test loss, test accuracy in eval mode)."""
    source = reference_source(cfg)
    model = build_model(cfg.model, source.num_classes, source.sample_shape[0],
                        source.sample_shape[1]).double()
    model.load_state_dict(state)
    sharding = Sharding(source.train_size, cfg.global_batch_size, seed=cfg.seed,
                        order=make_order(cfg, source))
    shares = []
    for step in steps:
        epoch, s = divmod(step, sharding.steps_per_epoch)
        own = sharding.replica_batch(epoch, s, 0, cfg.dp)[0]
        shares.append(source.images("train", own, torch.device("cpu"), epoch).double())
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    counts = [m.num_batches_tracked.clone() for m in bns]
    if cfg.num_microbatches == 1:
        update_bn(shares, model)
    else:
        seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in bns}
        record = [True]
        for m in bns:
            m.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0]) if record[0] else None)
            m.reset_running_stats()
            m.momentum = None
        model.train()
        with torch.no_grad():
            for x in shares:
                for m in bns:
                    m.track_running_stats = False
                record[0] = True
                for sl in split_slices(len(x), cfg.num_microbatches):
                    model(x[sl])
                record[0] = False
                for m in bns:
                    m.track_running_stats = True
                    m(torch.cat(seen[m]))
                    seen[m].clear()
    for m, c in zip(bns, counts):
        m.num_batches_tracked.copy_(c)
    model.eval()
    idx = torch.arange(source.test_size).numpy()
    with torch.no_grad():
        logits = model(source.images("test", idx, torch.device("cpu")).double())
    y = source.labels("test", idx)
    loss = nn.functional.cross_entropy(logits, y, reduction="sum").item() / source.test_size
    accuracy = (logits.argmax(1) == y).double().mean().item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, loss, accuracy

"""Tests for rayconv.recipe's schedule, optimizer groups and loss (no Ray), each against the torch or
torchvision code it reproduces; EMA, clipping and loss scaling are in test_recipe_step.py, mixup and
cutmix in test_recipe_mix.py."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torchvision.ops._utils import split_normalization_params

from rayconv.errors import ConfigError
from rayconv.models.convnet import ConvNet
from rayconv.parallel.batchnorm import defer_batchnorm
from rayconv.recipe.loss import cross_entropy, microbatch_loss
from rayconv.recipe.optim import group_of, make_optimizer, param_groups
from rayconv.recipe.lr_schedule import scaled_lr, schedule_lr

f64 = torch.float64


def _torch_lrs(schedulers, optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedulers.step()
    return out


# ---------------------------------------------------------------- schedule


@pytest.mark.parametrize("min_lr", [0.0, 0.003])
def test_schedule_lr_is_torchs_linear_warmup_then_cosine(min_lr: float) -> None:
    base, warm, total, decay = 0.4, 5, 23, 0.01
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=decay, total_iters=warm),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm, eta_min=min_lr),
        ],
        milestones=[warm],
    )
    want = _torch_lrs(sched, opt, total + 1)
    got = [schedule_lr(s, total, base, warm, decay, "cosine", min_lr=min_lr) for s in range(total + 1)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[0] == pytest.approx(base * decay) and got[warm] == pytest.approx(base)
    assert schedule_lr(total + 7, total, base, warm, decay, min_lr=min_lr) == pytest.approx(min_lr)


def test_schedule_lr_constant_warmup_and_constant_schedule() -> None:
    base, warm, total = 0.1, 4, 10
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    sched = torch.optim.lr_scheduler.ConstantLR(opt, factor=0.25, total_iters=warm)
    want = _torch_lrs(sched, opt, total)
    got = [schedule_lr(s, total, base, warm, 0.25, "constant", warmup_method="constant")
           for s in range(total)]
    assert got == pytest.approx(want, rel=1e-15)
    assert [schedule_lr(s, total, base, 0, schedule="constant") for s in range(total)] == [base] * total


def test_schedule_lr_without_warmup_is_plain_cosine() -> None:
    base, total = 0.05, 12
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    want = _torch_lrs(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total), opt, total)
    got = [schedule_lr(s, total, base) for s in range(total)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got == pytest.approx([base * 0.5 * (1 + math.cos(math.pi * s / total)) for s in range(total)],
                                rel=1e-15)


def test_schedule_lr_refusals() -> None:
    with pytest.raises(ConfigError, match="longer than the run"):
        schedule_lr(0, 5, 0.1, warmup_steps=6)
    with pytest.raises(ConfigError, match="lr-warmup-decay"):
        schedule_lr(0, 5, 0.1, warmup_steps=2, warmup_decay=0.0)
    with pytest.raises(ConfigError, match="schedule"):
        schedule_lr(0, 5, 0.1, schedule="step")
    with pytest.raises(ConfigError, match="warmup-method"):
        schedule_lr(0, 5, 0.1, warmup_method="exp")
    with pytest.raises(ConfigError, match=">= 0"):
        schedule_lr(-1, 5, 0.1)


def test_scaled_lr_is_goyals_linear_rule() -> None:
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 8192) == pytest.approx(3.2)  # Goyal et al.'s 8k batch
    assert scaled_lr(0.5, 64, reference=128) == pytest.approx(0.25)
    with pytest.raises(ConfigError):
        scaled_lr(0.1, 0)


# ---------------------------------------------------------------- optimizer groups


def test_param_groups_match_torchvisions_split_normalization_params() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    norm, other = split_normalization_params(model)
    groups = param_groups(model, 1e-4, norm_weight_decay=0.0)
    assert [g["name"] for g in groups] == ["other", "norm"]
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in other]
    assert [id(p) for p in groups[1]["params"]] == [id(p) for p in norm]
    assert (groups[0]["weight_decay"], groups[1]["weight_decay"]) == (1e-4, 0.0)
    # without --norm-weight-decay every parameter decays alike (torchvision's set_weight_decay)
    assert [g["name"] for g in param_groups(model, 1e-4)] == ["other"]


def _weight_decay_of(groups) -> dict[int, float]:
    return {id(p): g["weight_decay"] for g in groups for p in g["params"]}


@pytest.mark.parametrize("wrap", ["none", "deferred", "sync"])
def test_param_groups_of_pipeline_shards_equal_the_whole_models(wrap: str) -> None:
    model = torchvision.models.resnet18(num_classes=10)
    whole = _weight_decay_of(param_groups(model, 1e-4, 0.0, 0.5))
    children = list(model.children())
    got: dict[int, float] = {}
    for a, b in [(0, 3), (3, 6), (6, len(children))]:  # three pipeline stages
        stage: nn.Module = nn.Sequential(*children[a:b])
        if wrap == "deferred":
            stage = defer_batchnorm(stage)
        elif wrap == "sync":
            stage = nn.SyncBatchNorm.convert_sync_batchnorm(stage)
        got.update(_weight_decay_of(param_groups(stage, 1e-4, 0.0, 0.5)))
    assert got == whole
    assert sorted(set(whole.values())) == [0.0, 1e-4, 0.5]


def _column(conv: nn.Conv2d, bn: nn.BatchNorm2d, fc: nn.Linear, rows: slice) -> nn.Sequential:
    """A filter-split slice: the output channels ``rows`` of conv and bn, fc's input columns as they are."""
    n = rows.stop - rows.start
    c, b = nn.Conv2d(conv.in_channels, n, 3), nn.BatchNorm2d(n)
    for new, old in ((c, conv), (b, bn)):
        new.weight = nn.Parameter(old.weight.detach()[rows].clone())
        new.bias = nn.Parameter(old.bias.detach()[rows].clone())
    return nn.Sequential(c, b, nn.ReLU(), nn.Flatten(), copy.deepcopy(fc))


def test_param_groups_of_filter_split_shards_equal_the_whole_models() -> None:
    conv, bn, fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)
    whole = nn.Sequential(conv, bn, nn.ReLU(), nn.Flatten(), fc)
    for norm_wd, bias_wd in [(0.0, None), (0.0, 0.0), (None, 0.1)]:
        want = group_of(whole, norm_wd, bias_wd)
        for rows in (slice(0, 2), slice(2, 4)):
            assert group_of(_column(conv, bn, fc, rows), norm_wd, bias_wd) == want
    assert group_of(whole, 0.0, 0.1) == {"0.weight": "other", "0.bias": "bias", "1.weight": "norm",
                                         "1.bias": "bias", "4.weight": "other", "4.bias": "bias"}


def test_param_groups_skip_frozen_and_count_shared_parameters_once() -> None:
    model = ConvNet(batch_norm=True)
    model.conv1.weight.requires_grad_(False)
    tied = nn.Sequential(model, nn.Sequential(model.fc2))  # fc2 reachable twice
    groups = param_groups(tied, 5e-4, 0.0)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert id(model.conv1.weight) not in ids
    make_optimizer(groups, "sgd", 0.1)  # torch refuses a parameter listed twice


def test_norm_group_is_not_decayed_by_the_optimizer() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(f64)
    before = copy.deepcopy(model)
    opt = make_optimizer(param_groups(model, 0.1, norm_weight_decay=0.0), "sgd", lr=1.0, momentum=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(model[1].weight, before[1].weight) and torch.equal(model[1].bias, before[1].bias)
    assert torch.allclose(model[0].weight, before[0].weight * 0.9, rtol=1e-15)


@pytest.mark.parametrize("opt", ["sgd", "sgd_nesterov", "adamw"])
def test_optimizer_on_shards_moves_each_slice_as_on_the_whole_model(opt: str) -> None:
    torch.manual_seed(0)
    whole = nn.Linear(5, 6).to(f64)
    shards = [nn.Linear(5, 3).to(f64) for _ in range(2)]
    for k, s in enumerate(shards):
        s.weight.data.copy_(whole.weight.data[3 * k:3 * k + 3])
        s.bias.data.copy_(whole.bias.data[3 * k:3 * k + 3])
    opts = [make_optimizer(param_groups(m, 0.01, bias_weight_decay=0.0), opt, lr=0.1, momentum=0.9)
            for m in [whole] + shards]
    for _ in range(3):
        g_w, g_b = torch.randn(6, 5, dtype=f64), torch.randn(6, dtype=f64)
        whole.weight.grad, whole.bias.grad = g_w.clone(), g_b.clone()
        for k, s in enumerate(shards):
            s.weight.grad, s.bias.grad = g_w[3 * k:3 * k + 3].clone(), g_b[3 * k:3 * k + 3].clone()
        for o in opts:
            o.step()
    assert torch.equal(torch.cat([s.weight for s in shards]), whole.weight)
    assert torch.equal(torch.cat([s.bias for s in shards]), whole.bias)
    kind = torch.optim.AdamW if opt == "adamw" else torch.optim.SGD
    assert isinstance(opts[0], kind)
    if kind is torch.optim.SGD:
        assert opts[0].defaults["nesterov"] == (opt == "sgd_nesterov")


def test_make_optimizer_refusals() -> None:
    groups = param_groups(nn.Linear(2, 2), 0.0)
    with pytest.raises(ConfigError, match="unknown --opt"):
        make_optimizer(groups, "rmsprop", 0.1)
    with pytest.raises(ConfigError, match="momentum > 0"):
        make_optimizer(groups, "sgd_nesterov", 0.1, momentum=0.0)
    with pytest.raises(ConfigError, match="--lr"):
        make_optimizer(groups, "sgd", 0.0)
    with pytest.raises(ConfigError, match="norm-weight-decay"):
        param_groups(nn.Linear(2, 2), 0.0, norm_weight_decay=-1.0)


# ---------------------------------------------------------------- loss


def test_cross_entropy_with_smoothing_on_indices_and_soft_targets() -> None:
    torch.manual_seed(1)
    logits, y, eps = torch.randn(7, 5, dtype=f64), torch.randint(0, 5, (7,)), 0.1
    logp = logits.log_softmax(1)
    by_hand = ((1 - eps) * -logp.gather(1, y[:, None]).squeeze(1) + eps * -logp.mean(1)).mean()
    assert torch.allclose(cross_entropy(logits, y, eps), by_hand, rtol=1e-14)
    assert torch.allclose(cross_entropy(logits, y, eps), F.cross_entropy(logits, y, label_smoothing=eps),
                          rtol=1e-14)
    q = torch.softmax(torch.randn(7, 5, dtype=f64), 1)
    soft_by_hand = -(((1 - eps) * q + eps / 5) * logp).sum(1).mean()
    assert torch.allclose(cross_entropy(logits, q, eps), soft_by_hand, rtol=1e-14)
    one_hot = F.one_hot(y, 5).to(torch.float32)  # float32 probabilities are cast to the logits' dtype
    assert torch.allclose(cross_entropy(logits, one_hot, eps, "none"), cross_entropy(logits, y, eps, "none"),
                          rtol=1e-14)


def test_microbatch_losses_add_up_to_the_global_mean_with_uneven_pieces() -> None:
    torch.manual_seed(2)
    w = torch.randn(4, 3, dtype=f64, requires_grad=True)
    x, y = torch.randn(10, 4, dtype=f64), torch.randint(0, 3, (10,))
    full = cross_entropy(x @ w, y, 0.1)
    (g_full,) = torch.autograd.grad(full, w)
    pieces = [slice(0, 3), slice(3, 8), slice(8, 10)]  # replicas x micro-batches, uneven
    total = sum(microbatch_loss(x[s] @ w, y[s], 10, 0.1) for s in pieces)
    (g_sum,) = torch.autograd.grad(total, w)
    assert torch.allclose(total, full, rtol=1e-14) and torch.allclose(g_sum, g_full, rtol=1e-13)
    naive = sum(cross_entropy(x[s] @ w, y[s], 0.1) for s in pieces) / len(pieces)
    assert not torch.allclose(naive, full, rtol=1e-6)  # a mean of per-piece means weights them wrongly


def test_cross_entropy_refusals() -> None:
    logits = torch.zeros(3, 4)
    with pytest.raises(ConfigError, match="label-smoothing"):
        cross_entropy(logits, torch.zeros(3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="soft targets"):
        cross_entropy(logits, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="class indices"):
        cross_entropy(logits, torch.zeros(3))
    with pytest.raises(ConfigError, match="global-batch-size"):
        microbatch_loss(logits, torch.zeros(3, dtype=torch.long), 0)


@pytest.mark.parametrize("opt", ["sgd", "sgd_nesterov", "adamw"])
def test_the_optimizers_step_and_save_as_torch_optims_own(opt: str) -> None:
    # rayconv's SGD and AdamW are torch.optim's with the torch.compile guards unwrapped: the same
    # parameters after each step, bit for bit, the same state_dict, and it loads into torch's optimizer.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).to(f64)
    twin = copy.deepcopy(model)
    ours = make_optimizer(param_groups(model, 0.01, norm_weight_decay=0.0), opt, lr=0.1, momentum=0.9)
    groups = param_groups(twin, 0.01, norm_weight_decay=0.0)
    theirs = (torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01) if opt == "adamw" else torch.optim.SGD(
        groups, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=opt == "sgd_nesterov"))
    for _ in range(3):
        x = torch.randn(4, 5, dtype=f64)
        for m, o in ((model, ours), (twin, theirs)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q) and p.grad is not None
    ours.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    saved, expected = ours.state_dict(), theirs.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["state"].keys() == expected["state"].keys()
    for k, st in saved["state"].items():
        assert st.keys() == expected["state"][k].keys()
        assert all(torch.equal(v, expected["state"][k][n]) for n, v in st.items())
    theirs.load_state_dict(saved)
    ours.load_state_dict(expected)


def test_the_optimizers_do_not_import_torch_dynamo() -> None:
    # torch.optim's guards import torch._dynamo (nearly as costly as torch) in every actor's process;
    # rayconv's
    # optimizers build, step, zero and save without it.
    code = ("import sys, torch\n"
            "from rayconv.recipe.optim import make_optimizer, param_groups\n"
            "m = torch.nn.Linear(3, 2)\n"
            "for opt in ('sgd', 'adamw'):\n"
            "    o = make_optimizer(param_groups(m, 0.01), opt, 0.1)\n"
            "    m(torch.randn(2, 3)).sum().backward()\n"
            "    o.step(); o.zero_grad(); o.load_state_dict(o.state_dict())\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]

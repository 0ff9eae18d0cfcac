"""Tests for rayconv.recipe's schedule, optimizer groups, loss, EMA, clipping and loss scaling (no Ray),
each against the torch or torchvision code it reproduces; mixup and cutmix are in test_recipe_mix.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torchvision.ops._utils import split_normalization_params

from rayconv.errors import ConfigError
from rayconv.models.convnet import ConvNet
from rayconv.parallel.batchnorm import defer_batchnorm
from rayconv.recipe.clip import clip_, clip_coefficient, local_sq_norm
from rayconv.recipe.ema import ShardEMA, torchvision_ema_decay
from rayconv.recipe.loss import cross_entropy, microbatch_loss
from rayconv.recipe.loss_scale import DynamicLossScale, local_overflow, unscale_
from rayconv.recipe.optim import group_of, make_optimizer, param_groups
from rayconv.recipe.schedule import learning_rate, scaled_lr

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
def test_learning_rate_is_torchs_linear_warmup_then_cosine(min_lr: float) -> None:
    base, warm, total, decay = 0.4, 5, 23, 0.01
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=decay, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm, eta_min=min_lr)], milestones=[warm])
    want = _torch_lrs(sched, opt, total + 1)
    got = [learning_rate(s, total, base, warm, decay, "cosine", min_lr=min_lr) for s in range(total + 1)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[0] == pytest.approx(base * decay) and got[warm] == pytest.approx(base)
    assert learning_rate(total + 7, total, base, warm, decay, min_lr=min_lr) == pytest.approx(min_lr)


def test_learning_rate_constant_warmup_and_constant_schedule() -> None:
    base, warm, total = 0.1, 4, 10
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    sched = torch.optim.lr_scheduler.ConstantLR(opt, factor=0.25, total_iters=warm)
    want = _torch_lrs(sched, opt, total)
    got = [learning_rate(s, total, base, warm, 0.25, "constant", warmup_method="constant") for s in range(total)]
    assert got == pytest.approx(want, rel=1e-15)
    assert [learning_rate(s, total, base, 0, schedule="constant") for s in range(total)] == [base] * total


def test_learning_rate_without_warmup_is_plain_cosine() -> None:
    base, total = 0.05, 12
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    want = _torch_lrs(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total), opt, total)
    got = [learning_rate(s, total, base) for s in range(total)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got == pytest.approx([base * 0.5 * (1 + math.cos(math.pi * s / total)) for s in range(total)], rel=1e-15)


def test_learning_rate_refusals() -> None:
    with pytest.raises(ConfigError, match="longer than the run"):
        learning_rate(0, 5, 0.1, warmup_steps=6)
    with pytest.raises(ConfigError, match="lr-warmup-decay"):
        learning_rate(0, 5, 0.1, warmup_steps=2, warmup_decay=0.0)
    with pytest.raises(ConfigError, match="schedule"):
        learning_rate(0, 5, 0.1, schedule="step")
    with pytest.raises(ConfigError, match="warmup-method"):
        learning_rate(0, 5, 0.1, warmup_method="exp")
    with pytest.raises(ConfigError, match=">= 0"):
        learning_rate(-1, 5, 0.1)


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
    """A filter-split shard: the output channels ``rows`` of conv and bn, fc's input columns as they are."""
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
    assert type(opts[0]) is kind
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
    assert torch.allclose(cross_entropy(logits, y, eps), F.cross_entropy(logits, y, label_smoothing=eps), rtol=1e-14)
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


# ---------------------------------------------------------------- EMA


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2)).to(f64)


def _train_a_little(model: nn.Module, step: int) -> None:
    """Move parameters and batch-norm buffers as training would."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model(torch.randn(4, 2, 5, 5, dtype=f64) + step)


def test_ema_is_torchvisions_exponential_moving_average() -> None:
    torch.manual_seed(3)
    model = _bn_model()
    model(torch.randn(2, 2, 5, 5, dtype=f64))  # materialise the lazy layer
    decay, every, warm = 0.9, 2, 3
    # torchvision's ExponentialMovingAverage (references/classification/utils.py)
    ref = torch.optim.swa_utils.AveragedModel(model, avg_fn=lambda e, p, n: decay * e + (1 - decay) * p,
                                              use_buffers=True)
    ema = ShardEMA(model, decay, every)
    for i in range(11):
        _train_a_little(model, i)
        if i % every == 0:  # train.py's loop
            ref.update_parameters(model)
            if i < warm:
                ref.n_averaged.fill_(0)
        assert ema.update(model, i, reset=i < warm) == (i % every == 0)
    ref_state = ref.module.state_dict()
    for k, v in ema.tensors.items():
        if v.is_floating_point():
            assert torch.equal(v, ref_state[k]), k
    assert ema.tensors["1.num_batches_tracked"] == model[1].num_batches_tracked == 12  # copied, not averaged
    assert not torch.equal(ema.tensors["0.weight"], model[0].weight)


def test_ema_of_a_shard_is_the_shard_of_the_ema() -> None:
    torch.manual_seed(4)
    whole = nn.Linear(4, 6).to(torch.float32)
    shards = [nn.Linear(4, 3) for _ in range(2)]
    def split() -> None:
        for k, s in enumerate(shards):
            s.weight.data.copy_(whole.weight.data[3 * k:3 * k + 3])
            s.bias.data.copy_(whole.bias.data[3 * k:3 * k + 3])
    split()
    emas = [ShardEMA(m, 0.99) for m in [whole] + shards]
    for step in range(6):
        with torch.no_grad():
            whole.weight.mul_(1.1).add_(0.3)
            whole.bias.sub_(0.7)
        split()
        for m, e in zip([whole] + shards, emas):
            e.update(m, step)
    for key in ("weight", "bias"):
        assert torch.equal(torch.cat([e.tensors[key] for e in emas[1:]]), emas[0].tensors[key])
    assert not torch.equal(emas[0].tensors["weight"], whole.weight)


def test_ema_state_dict_resumes_the_same_average() -> None:
    torch.manual_seed(5)
    model = nn.Linear(3, 2).to(f64)
    straight, first = ShardEMA(model, 0.8), ShardEMA(model, 0.8)
    for step in range(8):
        with torch.no_grad():
            model.weight.add_(1.0)
        straight.update(model, step)
        if step < 4:
            first.update(model, step)
        if step == 3:
            resumed = ShardEMA(model, 0.5, every=3)
            resumed.load_state_dict(copy.deepcopy(first.state_dict()))
        if step >= 4:
            resumed.update(model, step)
    assert torch.equal(resumed.tensors["weight"], straight.tensors["weight"])
    target = nn.Linear(3, 2).to(f64)
    resumed.copy_to(target)
    assert torch.equal(target.weight, straight.tensors["weight"])
    with pytest.raises(KeyError):
        resumed.update(nn.Linear(3, 2, bias=False).to(f64), 8)


def test_torchvision_ema_decay_adjustment() -> None:
    # train.py's resnet50 v2 recipe: --model-ema-decay 0.99998, 8 GPUs x 128 images, steps 32, 600 epochs
    alpha = (1 - 0.99998) * 1024 * 32 / 600
    assert torchvision_ema_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - alpha, rel=1e-15)
    assert torchvision_ema_decay(0.9, 1024, 32, 1) == 0.0  # alpha capped at 1
    with pytest.raises(ConfigError):
        torchvision_ema_decay(1.5, 1, 1, 1)


# ---------------------------------------------------------------- gradient clipping


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_over_shards_equals_clip_grad_norm_on_the_whole_model(max_norm: float) -> None:
    torch.manual_seed(6)
    whole = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).to(f64)
    for p in whole.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in whole.named_parameters()}
    ref = copy.deepcopy(whole)  # (deepcopy leaves gradients behind)
    for n, p in ref.named_parameters():
        p.grad = grads[n].clone()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    # mesh pp=2 x fs=2: stage 0 splits the first layer's rows over fs, stage 1 holds the last layer whole
    def param(g: torch.Tensor) -> nn.Parameter:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        return p
    actors = []
    for fs in range(2):
        rows = slice(3 * fs, 3 * fs + 3)
        actors.append({"own": [param(grads["0.weight"][rows]), param(grads["0.bias"][rows])], "rep": [], "fs": fs})
    for fs in range(2):
        actors.append({"own": [], "rep": [param(grads["2.weight"]), param(grads["2.bias"])], "fs": fs})
    total = sum(local_sq_norm(a["own"], a["rep"], count_replicated=a["fs"] == 0) for a in actors)  # all-reduce
    assert total.dtype == f64 and torch.allclose(total.sqrt(), norm, rtol=1e-13)
    coef = clip_coefficient(total, max_norm)
    for a in actors:
        clip_(a["own"] + a["rep"], coef)
    got0 = torch.cat([actors[0]["own"][0].grad, actors[1]["own"][0].grad])
    assert torch.allclose(got0, ref[0].weight.grad, rtol=1e-13)
    for a in actors[2:]:
        assert torch.allclose(a["rep"][0].grad, ref[2].weight.grad, rtol=1e-13)
    assert (coef.item() == 1.0) == (max_norm == 1e6)
    twice = sum(local_sq_norm(a["own"], a["rep"]) for a in actors)  # replicated counted by both holders
    assert not torch.allclose(twice, total)


def test_local_sq_norm_mixed_dtypes_and_no_grads() -> None:
    a = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    a.grad = torch.full((3,), 300.0, dtype=torch.float16)  # its square overflows float16
    b = nn.Parameter(torch.zeros(2))
    assert local_sq_norm([a, b]).item() == pytest.approx(3 * 300.0 ** 2)
    assert local_sq_norm([b]).item() == 0.0 and local_sq_norm([b]).dtype == f64
    with pytest.raises(ConfigError, match="clip-grad-norm"):
        clip_coefficient(torch.tensor(1.0), 0.0)


# ---------------------------------------------------------------- loss scaling


def test_loss_scale_follows_gradscaler_through_forced_overflows() -> None:
    overflow = [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    ours = DynamicLossScale(growth_interval=3)
    want, got = [], []
    for bad in overflow:
        opt.zero_grad()
        before = p.detach().clone()
        scaler.scale((p * 2).sum()).backward()
        if bad:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        want.append((scaler.get_scale(), torch.equal(p, before)))
        skipped = ours.update(torch.tensor(float(bad)))  # the flag after the caller's all-reduce
        got.append((ours.scale, skipped))
    assert got == want
    assert len({s for s, _ in got}) > 2  # the scale both grew and shrank
    theirs = scaler.state_dict()
    assert ours.state_dict() == {k: theirs[k] for k in ours.state_dict()}


def test_loss_scale_defaults_state_dict_and_float32_ceiling() -> None:
    default = DynamicLossScale().state_dict()
    assert default == {k: v for k, v in torch.amp.GradScaler("cpu").state_dict().items() if k in default}
    s = DynamicLossScale(init_scale=2.0 ** 127, growth_interval=1)
    assert not s.update(False) and s.scale == 2.0 ** 127  # 2**128 is inf in float32: kept
    t = DynamicLossScale()
    t.load_state_dict({"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2,
                       "_growth_tracker": 1})
    assert not t.update(0.0) and t.scale == 16.0
    assert t.update(True) and t.scale == 8.0
    with pytest.raises(ConfigError):
        DynamicLossScale(backoff_factor=1.0)


def test_local_overflow_and_unscale_agree_with_gradscaler() -> None:
    ps = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2, dtype=torch.float16)), nn.Parameter(torch.zeros(1))]
    for value, want in [(1.0, 0.0), (float("inf"), 1.0), (float("nan"), 1.0)]:
        ps[0].grad = torch.full((4,), 3.0)
        ps[1].grad = torch.tensor([1.0, value], dtype=torch.float16)
        flag = local_overflow(ps)
        assert flag.dtype == torch.float32 and flag.dim() == 0 and flag.item() == want
    ps[1].grad = torch.tensor([6.0, 2.0], dtype=torch.float16)
    # GradScaler unscales float32 gradients only (it refuses float16 ones); float16 takes the same kernel
    ref = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2))]
    ref[0].grad, ref[1].grad = ps[0].grad.clone(), torch.tensor([7.0, 1e-3])
    mine = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2))]
    mine[0].grad, mine[1].grad = ref[0].grad.clone(), ref[1].grad.clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0)
    scaler.scale(torch.ones(()))  # makes its scale tensor
    scaler.unscale_(torch.optim.SGD(ref, lr=0.1))
    assert unscale_(mine, 3.0).item() == 0.0
    assert torch.equal(mine[0].grad, ref[0].grad) and torch.equal(mine[1].grad, ref[1].grad)
    assert unscale_(ps, 4.0).item() == 0.0
    assert ps[0].grad[0].item() == 0.75 and ps[1].grad.tolist() == [1.5, 0.5]
    ps[0].grad[2] = float("inf")
    assert unscale_(ps, 4.0).item() == 1.0
    assert local_overflow([ps[2]]).item() == 0.0  # no gradients at all

"""Tests for rayconv.recipe's EMA, gradient clipping over shards and loss scaling (no Ray), each against
the torch or torchvision code it reproduces."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rayconv.errors import ConfigError
from rayconv.recipe.clip import clip_, clip_coefficient, local_sq_norm
from rayconv.recipe.ema import PartEMA, torchvision_ema_decay
from rayconv.recipe.loss_scale import DynamicLossScale, local_overflow, unscale_

f64 = torch.float64


# ---------------------------------------------------------------- EMA


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                         nn.LazyLinear(2)).to(f64)


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
    ema = PartEMA(model, decay, every)
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
    emas = [PartEMA(m, 0.99) for m in [whole] + shards]
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
    straight, first = PartEMA(model, 0.8), PartEMA(model, 0.8)
    for step in range(8):
        with torch.no_grad():
            model.weight.add_(1.0)
        straight.update(model, step)
        if step < 4:
            first.update(model, step)
        if step == 3:
            resumed = PartEMA(model, 0.5, every=3)
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
        actors.append({"own": [param(grads["0.weight"][rows]), param(grads["0.bias"][rows])], "rep": [],
                       "fs": fs})
    for fs in range(2):
        actors.append({"own": [], "rep": [param(grads["2.weight"]), param(grads["2.bias"])], "fs": fs})
    # all-reduce
    total = sum(local_sq_norm(a["own"], a["rep"], count_replicated=a["fs"] == 0) for a in actors)
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
    ps = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2, dtype=torch.float16)),
          nn.Parameter(torch.zeros(1))]
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

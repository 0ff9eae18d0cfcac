"""LARS (``recipe.lars``) on one process: the trust ratio of You et al. 2017's Algorithm 1, a split
tensor's slices scaled by the whole tensor's ratio, the adapted groups, and the flag's checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from support.helpers import reference_recipe_sgd, sgd_config
from rayconv.config import Config
from rayconv.errors import ConfigError
from rayconv.recipe.lars import adapted_params, lars_param_groups, scale_, sq_norms
from rayconv.recipe.optim import make_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5)).double()


def test_scale_is_the_trust_ratio_times_the_decayed_gradient():
    model, eta, wd = _model(), 0.02, 5e-4
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    weights = [model[0].weight, model[3].weight]
    want = [eta * w.norm() / (w.grad.norm() + wd * w.norm()) * (w.grad + wd * w) for w in weights]
    scale_(weights, [wd, wd], sq_norms(weights, torch.device("cpu")), eta)
    for w, g in zip(weights, want):
        torch.testing.assert_close(w.grad, g, rtol=1e-14, atol=0)
    zero = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # a zero-initialised layer: ratio 1
    zero.grad = torch.ones(3, dtype=torch.float64)
    scale_([zero], [wd], sq_norms([zero], torch.device("cpu")), eta)
    assert torch.equal(zero.grad, torch.ones(3, dtype=torch.float64))


def test_slices_take_the_whole_tensors_ratio():
    """Two filter-split slices whose squared norms are summed (the all-reduce's sum) are scaled as the
    whole tensor is; scaled each by its own norms they are not."""
    torch.manual_seed(1)
    whole = nn.Parameter(torch.randn(8, 3, dtype=torch.float64))
    whole.grad = torch.randn_like(whole) * torch.arange(1.0, 9.0, dtype=torch.float64)[:, None]
    halves = [nn.Parameter(whole.detach()[i * 4:(i + 1) * 4].clone()) for i in range(2)]
    for i, h in enumerate(halves):
        h.grad = whole.grad[i * 4:(i + 1) * 4].clone()
    total = sum(sq_norms([h], torch.device("cpu")) for h in halves)
    alone = [h.grad.clone() for h in halves]
    for h in halves:
        scale_([h], [1e-4], total, 0.01)
    scale_([whole], [1e-4], sq_norms([whole], torch.device("cpu")), 0.01)
    torch.testing.assert_close(torch.cat([h.grad for h in halves]), whole.grad, rtol=1e-14, atol=0)
    own = []
    for i, a in enumerate(alone):
        p = nn.Parameter(whole.detach()[i * 4:(i + 1) * 4].clone())
        p.grad = a
        scale_([p], [1e-4], sq_norms([p], torch.device("cpu")), 0.01)
        own.append(p.grad)
    assert float((torch.cat(own) - whole.grad).abs().max()) > 1e-3


def test_groups_leave_norm_layers_and_biases_to_sgd():
    model = _model()
    groups = lars_param_groups(model, 5e-4)
    opt = make_optimizer(groups, "lars", 1.0)
    assert [g["name"] for g in groups] == ["other", "norm", "bias"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 5e-4, 5e-4]
    adapted = adapted_params(opt)
    assert [id(p) for p, _ in adapted] == [id(model[0].weight), id(model[3].weight)]
    assert all(wd == 5e-4 for _, wd in adapted) and not opt.param_groups[0]["nesterov"]
    assert [g["weight_decay"] for g in lars_param_groups(model, 5e-4, 0.0, 0.0)] == [0.0, 0.0, 0.0]


def test_lars_changes_the_reference(tmp_path):
    """The layouts' LARS test can fail: the reference with LARS differs from plain SGD at the same lr,
    and from LARS with another trust coefficient, by far more than its 1e-10."""
    kw = dict(model="convnet_bn", global_batch_size=480, steps=3, lr=1.0)
    lars = reference_recipe_sgd(sgd_config(tmp_path, "a", opt="lars", lars_trust_coefficient=0.02, **kw),
                                3)[0]
    other = reference_recipe_sgd(sgd_config(tmp_path, "b", opt="lars", lars_trust_coefficient=0.01, **kw),
                                 3)[0]
    sgd = reference_recipe_sgd(sgd_config(tmp_path, "c", opt="sgd", **kw), 3)[0]
    for name, b in (("trust coefficient", other), ("sgd", sgd)):
        diff = max(float((lars[k] - b[k]).abs().max()) for k in lars if not k.endswith("num_batches_tracked"))
        assert diff > 1e-4, f"LARS against {name}: {diff:g}"


@pytest.mark.parametrize("value", [0.0, -0.01])
def test_trust_coefficient_must_be_positive(value):
    with pytest.raises(ConfigError, match="--lars-trust-coefficient must be > 0"):
        Config(opt="lars", lars_trust_coefficient=value).validate()


def test_trust_coefficient_belongs_to_lars():
    with pytest.raises(ConfigError, match="--lars-trust-coefficient is --opt lars's"):
        Config(opt="sgd", lars_trust_coefficient=0.01).validate()
    assert Config(opt="lars", lars_trust_coefficient=0.01).validate().lars_trust_coefficient == 0.01

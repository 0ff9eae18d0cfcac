"""The training recipe on the mesh equals it on one device: label smoothing, Nesterov SGD, no weight
decay on batch norm, a warm-up of the learning rate, global-norm gradient clipping, the moving
average of the weights and a batch-norm momentum, all on at once, over data parallelism, 1F1B and
interleaved pipelines, filter split and Krizhevsky 2014's per-layer plan, to 1e-10 in float64 (weights and the
average's). The reference (``helpers.reference_recipe_sgd``) is plain torch: ``nn.CrossEntropyLoss``'s
smoothing, ``torch.optim.SGD(nesterov=True)``, ``nn.utils.clip_grad_norm_``, ``AveragedModel`` as
torchvision's train.py drives it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.helpers import assert_same_state, reference_recipe_sgd, sgd_config, slow_among
from rayconv.actor.cuda_graph import sgd_step
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.recipe.optim import make_optimizer, param_groups

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 6  # global batch 480 of the 1438 digits: 3 steps an epoch (the last 478), the warm-up the first

# Every element of the recipe on. clip 0.5 is below every step's gradient norm (0.59 to 0.70), so every
# step clips; the EMA updates at batches 0 and 2 of each epoch, copying during the warm-up epoch.
RECIPE = dict(model="convnet_bn", global_batch_size=480, steps=STEPS, eval_every=STEPS, label_smoothing=0.1,
              opt="sgd_nesterov", norm_weight_decay=0.0, lr_warmup_epochs=1, clip_grad_norm=0.5,
              model_ema=True, model_ema_steps=2, model_ema_decay=0.999, bn_momentum=0.3)

LAYOUTS = {
    "dp2": dict(dp=2),
    "pp2-1f1b-m2": dict(pp=2, num_microbatches=2),
    "pp2-interleaved-v2-m4": dict(pp=2, virtual_stages=2, num_microbatches=4),
    "fs2": dict(fs=2),
    "plan-krizhevsky2014-dp2": dict(dp=2, plan="krizhevsky2014"),
}

# Each element turned off (or changed), one at a time: each must change the reference's result.
OFF = {
    "label_smoothing": dict(label_smoothing=0.0),
    "opt": dict(opt="sgd"),
    "norm_weight_decay": dict(norm_weight_decay=None),
    "lr_warmup_epochs": dict(lr_warmup_epochs=0),
    "clip_grad_norm": dict(clip_grad_norm=None),
    "model_ema_steps": dict(model_ema_steps=1),
    "bn_momentum": dict(bn_momentum=None),
}


def recipe_config(tmp_path, name, **kw) -> Config:
    return sgd_config(tmp_path, name, **{**RECIPE, **kw})


# Settings the reference never reads (how the mesh cuts the model, where the run writes): runs that
# differ only in these share one reference computation (fs2's is the recipe's own, dp2's the plan's).
_MESH_ONLY = {"out", "pp", "fs", "plan", "virtual_stages", "schedule"}
_REFERENCES: dict[tuple, tuple] = {}


def cached_reference(cfg: Config, steps: int) -> tuple:
    """``reference_recipe_sgd(cfg, steps)``, computed once per (``cfg`` less ``_MESH_ONLY``, steps)."""
    key = (steps, *((f.name, repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)
                    if f.name not in _MESH_ONLY))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_recipe_sgd(cfg, steps)
    return _REFERENCES[key]


def _without_counts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model_state`` less ``num_batches_tracked`` (torch's AveragedModel averages that integer into a
    truncated float; rayconv's moving average copies it, ``recipe.ema``)."""
    return {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}


@pytest.mark.parametrize("name", slow_among(LAYOUTS, {"dp2", "pp2-1f1b-m2", "pp2-interleaved-v2-m4", "fs2"}))
def test_recipe_layout_matches_single_device(ray_cluster, tmp_path, name):
    cfg = recipe_config(tmp_path, name, **LAYOUTS[name])
    summary = train_run(cfg, log=lambda *_: None)
    want, want_ema = cached_reference(cfg, STEPS)
    assert_same_state(torch.load(tmp_path / name / "model.pt", weights_only=True), want, atol=1e-10)
    got_ema = torch.load(tmp_path / name / "model_ema.pt", weights_only=True)
    assert_same_state(_without_counts(got_ema), _without_counts(want_ema), atol=1e-10)
    assert summary["ema_test_accuracy"] is not None


# LARS at a learning rate it is used with (the trust ratio makes each step move a layer by about lr x eta
# of its norm): its ratios are of whole tensors, so a filter-split layer's slices, and the per-layer
# plan's split fully connected layers, sum their norms over the shards before scaling.
LARS = dict(opt="lars", lr=1.0, lars_trust_coefficient=0.02)


@pytest.mark.parametrize("name", [pytest.param("fs2", marks=pytest.mark.slow),
                                  pytest.param("plan-krizhevsky2014-dp2", marks=pytest.mark.slow)])
def test_lars_layout_matches_single_device(ray_cluster, tmp_path, name):
    cfg = recipe_config(tmp_path, name, **LARS, **LAYOUTS[name])
    train_run(cfg, log=lambda *_: None)
    want, _ = reference_recipe_sgd(cfg, STEPS)
    assert_same_state(torch.load(tmp_path / name / "model.pt", weights_only=True), want, atol=1e-10)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a
               if not k.endswith("num_batches_tracked"))


@pytest.mark.slow
def test_each_element_of_the_recipe_changes_the_reference(tmp_path):
    """The layouts' test can fail: each element of the recipe, turned off, changes the weights or the
    average by far more than 1e-10; and the average is not the weights."""
    want, want_ema = cached_reference(recipe_config(tmp_path, "on"), STEPS)
    assert _max_diff(want, want_ema) > 1e-4
    for name, kw in OFF.items():
        got, got_ema = reference_recipe_sgd(recipe_config(tmp_path, name, **kw), STEPS)
        diff = _max_diff(got_ema, want_ema) if name.startswith("model_ema") else _max_diff(got, want)
        assert diff > 1e-6, f"turning {name} off changed nothing ({diff:g})"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_captured_update_equals_torch_sgd(dtype):
    """``cuda_graph.sgd_step`` (the update a CUDA graph captures; foreach arithmetic on CPU) moves
    parameters and momentum as torch.optim.SGD does, with Nesterov momentum and a group without weight
    decay, over three steps of the same gradients (the first makes the buffers): to rounding, as
    ``p - lr * g`` and torch's ``p + (-lr) * g`` may round apart by an ulp."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 3)).to(dtype)
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                               torch.nn.Linear(4, 3)).to(dtype)
    twin.load_state_dict(model.state_dict())
    opts = [make_optimizer(param_groups(m, 5e-4, norm_weight_decay=0.0), "sgd_nesterov", 0.1)
            for m in (model, twin)]
    assert [g["weight_decay"] for g in opts[1].param_groups] == [5e-4, 0.0]
    lr = {dtype: torch.tensor(0.1, dtype=dtype)}
    tol = dict(rtol=0, atol=1e-14 if dtype == torch.float64 else 1e-6)
    for step in range(3):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opts[0].step()
        sgd_step(opts[1], lr)
        for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"step {step}: {k}: {m}")
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(opts[0].state[p]["momentum_buffer"],
                                       opts[1].state[q]["momentum_buffer"], **tol)

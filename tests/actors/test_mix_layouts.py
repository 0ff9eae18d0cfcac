"""Mixup and cutmix in the batch path (rayconv/actor/batches.py) on a real local Ray cluster: with both
on (seed 0 draws mixup, cutmix, cutmix for the three steps), dp=2, pp=2 (1F1B, 2 micro-batches) and
fs=2 equal single-device SGD on the same mixed global batches, parameter for parameter, in float64;
and the mix changes the result."""

from __future__ import annotations

import pytest
import torch

from support.helpers import assert_same_state, reference_mix_sgd, reference_sgd, sgd_config
from rayconv.driver.job import train_run
from rayconv.recipe.mix import draw_mix

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 3
MIX = dict(mixup_alpha=0.4, cutmix_alpha=1.0, seed=0)
LAYOUTS = {"dp2": dict(dp=2), "pp2-1f1b-m2": dict(pp=2, schedule="1f1b", num_microbatches=2),
           "fs2": dict(fs=2)}


def test_the_steps_draw_both_kinds():
    kinds = [draw_mix(0, t, 96, MIX["mixup_alpha"], MIX["cutmix_alpha"], (8, 8)).kind for t in range(STEPS)]
    assert set(kinds) == {"mixup", "cutmix"}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mixed_layout_matches_single_device_sgd(ray_cluster, tmp_path, name):
    cfg = sgd_config(tmp_path, name, steps=STEPS, eval_every=STEPS, **MIX, **LAYOUTS[name])
    train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / name / "model.pt", weights_only=True)
    want = reference_mix_sgd(cfg, STEPS)
    assert_same_state(got, want, atol=1e-10)
    if name == "dp2":   # the mix really reaches the step: without it the weights differ
        plain = reference_sgd(cfg, STEPS)
        assert max((want[k] - plain[k]).abs().max().item() for k in want) > 1e-4

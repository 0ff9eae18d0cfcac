"""``--evaluate-only --init runs/r/model.pt`` reports the test figures that run r reported, in every
layout: one float64 run of rayconv's ConvNet on the digits (one actor), then its model.pt evaluated
under dp, pp, dp x pp, fs and the per-layer plan. Top-1 and top-5 equal the run's, the test loss
agrees to 1e-12 (the weights enter the float64 actors exactly; only the summation order differs)."""

from __future__ import annotations

import dataclasses

import pytest

from support.helpers import sgd_config, slow_among
from rayconv.driver.job import train_run

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 40
LAYOUTS = {
    # (first: the runs after it take two of its four actors)
    "dp2-pp2": dict(dp=2, pp=2, num_microbatches=2),
    "dp2": dict(dp=2),
    "pp2-1f1b-m2": dict(pp=2, schedule="1f1b", num_microbatches=2),
    "fs2": dict(fs=2),
    "plan-krizhevsky2014-dp2": dict(dp=2, plan="krizhevsky2014"),
}


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate-layouts")
    cfg = sgd_config(tmp, "r", steps=STEPS, eval_every=STEPS, lr=0.2, loader_workers=0)
    return cfg, train_run(cfg, log=lambda *_: None)


@pytest.mark.parametrize("name", slow_among(LAYOUTS, {"dp2-pp2", "dp2"}))
def test_evaluate_only_reports_the_runs_accuracy(trained, tmp_path, name):
    cfg, summary = trained
    ev_cfg = dataclasses.replace(cfg, init=f"{cfg.out}/model.pt", evaluate_only=True,
                                 out=str(tmp_path / name), **LAYOUTS[name]).validate()
    ev = train_run(ev_cfg, log=lambda *_: None)
    assert ev["steps"] == 0 and ev["evaluate_only"] and ev["layout"]["world_size"] > 1
    assert ev["test_accuracy"] == summary["test_accuracy"]
    assert ev["test_top5_accuracy"] == summary["test_top5_accuracy"]
    assert summary["test_accuracy"] > 0.5  # (a model that learned: its predictions are not ties)
    assert abs(ev["test_loss"] - summary["test_loss"]) < 1e-12

"""Precise BN (``--precise-bn-batches N``, ``actor/precise_bn.py``): before each evaluation the batch-norm
running statistics are recomputed as the average over the next N training batches, in every layout
equal to one device (float64, to 1e-10), and no training step changes.

The reference is single-device float64 training (``helpers.reference_recipe_sgd``), then the statistics
recomputed as ``torch.optim.swa_utils.update_bn`` does over dp replica 0's share of the global batches
of steps STEPS .. STEPS + N - 1 (statistics follow replica 0); under micro-batches each share runs as
its micro-batches, each normalised by its own statistics, a batch's statistics taken over the share
(``helpers.recalibrated``). ``num_batches_tracked`` keeps counting the training steps.
"""

from __future__ import annotations

import dataclasses

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn

from support.helpers import assert_same_state, recalibrated, reference_recipe_sgd, sgd_config, slow_among
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.parallel.batchnorm import averaged_statistics, defer_batchnorm

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

# Global batch 480 of the 1438 digits: 3 steps an epoch, the last of 478 samples. The last evaluation's
# batches are those of steps 2 (the partial one), 3 and 4 (the next epoch's order).
STEPS, N = 2, 3
RUN = dict(model="convnet_bn", global_batch_size=480, steps=STEPS, eval_every=STEPS, precise_bn_batches=N,
           model_ema=True, model_ema_steps=1, model_ema_decay=0.999)
STATS = ("running_mean", "running_var", "num_batches_tracked")

LAYOUTS = {"dp1": {}, "dp2": dict(dp=2), "fs2": dict(fs=2),   # (and a pipeline: the next test)
           "plan-dp2": dict(dp=2, plan="krizhevsky2014")}


def run_config(tmp_path, name, **kw) -> Config:
    return sgd_config(tmp_path, name, **{**RUN, **kw})


def _without_counts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """less ``num_batches_tracked`` (torch's AveragedModel averages that integer into a truncated float;
    rayconv's moving average copies it, ``recipe.ema``)."""
    return {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}


# Settings the references never read (how the mesh cuts the model, where the run writes): layouts that
# differ only in these share one computation (fs2's is dp1's, plan-dp2's dp2's).
_MESH_ONLY = {"out", "pp", "fs", "plan", "virtual_stages", "schedule"}
_REFERENCES: dict[tuple, tuple] = {}


def references(cfg: Config) -> tuple:
    """(trained, (recalibrated, loss, accuracy), (the average recalibrated, loss, accuracy)) for ``cfg``,
    computed once per ``cfg`` less ``_MESH_ONLY``."""
    key = tuple((f.name, repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)
                if f.name not in _MESH_ONLY)
    if key not in _REFERENCES:
        trained, trained_ema = reference_recipe_sgd(cfg, STEPS)
        _REFERENCES[key] = (trained, recalibrated(cfg, trained, range(STEPS, STEPS + N)),
                            recalibrated(cfg, trained_ema, range(STEPS, STEPS + N)))
    return _REFERENCES[key]


def check_against_reference(cfg: Config, summary: dict) -> None:
    """model.pt and model_ema.pt (written after the last evaluation) hold the reference's recomputed
    statistics (and weights), and the test loss and accuracies are the reference's in eval mode."""
    trained, (want, loss, accuracy), (want_ema, _, ema_accuracy) = references(cfg)
    got = torch.load(f"{cfg.out}/model.pt", weights_only=True)
    assert_same_state(got, want, atol=1e-10)
    assert [int(got[k]) for k in got if k.endswith("num_batches_tracked")] == [STEPS] * 3
    assert max(float((got[k] - trained[k]).abs().max()) for k in got if k.endswith("running_var")) > 1e-3
    got_ema = torch.load(f"{cfg.out}/model_ema.pt", weights_only=True)
    assert_same_state(_without_counts(got_ema), _without_counts(want_ema), atol=1e-10)
    assert abs(summary["test_loss"] - loss) < 1e-10
    assert summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert summary["ema_test_accuracy"] == pytest.approx(ema_accuracy, abs=1e-12)


@pytest.mark.parametrize("name", slow_among(LAYOUTS, {"dp2", "fs2", "plan-dp2"}))
def test_statistics_and_accuracy_equal_one_device_recalibrated(ray_cluster, tmp_path, name):
    cfg = run_config(tmp_path, name, **LAYOUTS[name])
    check_against_reference(cfg, train_run(cfg, log=lambda *_: None))


@pytest.mark.slow
def test_pipeline_equals_one_device_and_trains_as_without_it(ray_cluster, tmp_path):
    """Recomputed before every evaluation (after each step here) on a pipeline with micro-batches and the
    moving average: the last evaluation's statistics and figures equal the reference's, and the weights,
    the average's weights and every step's loss equal a run without it exactly (atol 0)."""
    kw = dict(pp=2, num_microbatches=2, eval_every=1)
    cfg = run_config(tmp_path, "with", **kw)
    check_against_reference(cfg, train_run(cfg, log=lambda *_: None))
    train_run(run_config(tmp_path, "without", **kw, precise_bn_batches=0), log=lambda *_: None)
    for file in ("model.pt", "model_ema.pt"):
        got, want = (torch.load(tmp_path / run / file, weights_only=True) for run in ("with", "without"))
        weights = [k for k in want if not k.endswith(STATS)]
        assert_same_state({k: got[k] for k in weights}, {k: want[k] for k in weights}, atol=0)
        assert any(not torch.equal(got[k], want[k]) for k in want if k.endswith("running_mean"))
    losses = [[r["loss"] for r in pq.read_table(tmp_path / run / "metrics.parquet").to_pylist()
               if r["kind"] == "train"] for run in ("with", "without")]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS


@pytest.mark.parametrize("deferred", [False, True])
def test_averaged_statistics_equal_update_bn(deferred):
    """One layer, no Ray: three batches seen inside ``averaged_statistics`` (a deferred layer's as two
    micro-batches and a commit each) leave update_bn's statistics, the momentum and count restored."""
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(3, momentum=0.3).double()
    layer = defer_batchnorm(nn.BatchNorm2d(3, momentum=0.3).double()) if deferred else \
        nn.BatchNorm2d(3, momentum=0.3).double()
    layer.num_batches_tracked.fill_(7)
    xs = [torch.randn(6, 3, 4, 4, dtype=torch.float64) * 2 + 1 for _ in range(3)]
    update_bn(xs, ref)
    with averaged_statistics([layer]), torch.no_grad():
        for x in xs:
            if deferred:
                layer(x[:4])
                layer(x[4:])
                layer.commit()
            else:
                layer(x)
    torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=0, atol=1e-14)
    torch.testing.assert_close(layer.running_var, ref.running_var, rtol=0, atol=1e-14)
    assert layer.momentum == 0.3 and int(layer.num_batches_tracked) == 7

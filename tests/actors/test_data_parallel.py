"""Data parallelism on a real local Ray cluster equals single-device SGD, parameter for parameter."""

from __future__ import annotations

import pytest
import torch

from support.helpers import assert_same_state, reference_sgd, slow_among
from rayconv.actor.actor import Actor
from rayconv.config import Config
from rayconv.driver.job import train_run

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

# 1438 train digits, global batch 102: 14 full steps + a last partial batch of 10 per epoch.
# dp=4 splits 102 as 26,26,25,25 and the last batch as 3,3,2,2: uneven shards are weighted exactly.
STEPS = 16


def dp_config(tmp_path, dp: int, **kw) -> Config:
    base = dict(model="convnet", data="digits", dp=dp, global_batch_size=102, steps=STEPS, lr=0.05,
                momentum=0.9, weight_decay=5e-4, precision="fp64", device="cpu", progress=False,
                eval_every=STEPS, out=str(tmp_path / f"run-dp{dp}"))
    base.update(kw)
    return Config(**base).validate()


# dp=2 holds out --val-split 0.1 (143 digits): 1295 train, 13 steps an epoch, the same batches as the
# single-device reference (which draws the split from the seed as well). The largest first: the smaller
# runs after it take its first actors (``cluster.pool.take``).
@pytest.mark.parametrize("dp, val_split", slow_among([(4, 0.0), (2, 0.1), (1, 0.0)], [(1, 0.0), (4, 0.0)]))
def test_dp_matches_single_device_sgd(ray_cluster, tmp_path, dp, val_split):
    cfg = dp_config(tmp_path, dp, val_split=val_split)
    replica_states = []

    def check_replicas(actor_group, step):
        # After every step, all replicas hold identical parameters and buffers.
        states = actor_group.call(Actor.model_state)
        for s in states[1:]:
            assert_same_state(s, states[0], atol=0.0)
        replica_states.append(step)

    summary = train_run(cfg, log=lambda *_: None, on_step=check_replicas)
    assert replica_states == list(range(STEPS))
    assert summary["layout"]["dp"] == dp
    got = torch.load(tmp_path / f"run-dp{dp}" / "model.pt", weights_only=True)
    want = reference_sgd(cfg, STEPS)
    assert_same_state(got, want, atol=1e-10)
    # The parameters moved: a layout that never stepped would not pass by accident.
    torch.manual_seed(cfg.seed)
    from rayconv.models import ConvNet
    init = ConvNet(1, 10).double().state_dict()
    assert max((got[k].double() - init[k]).abs().max().item() for k in init) > 1e-3
    # The final evaluation saw each of the 359 held-out digits once (dp=4: 90, 90, 90, 89 per replica).
    n = 359
    acc = summary["test_accuracy"]
    assert abs(acc * n - round(acc * n)) < 1e-9, "accuracy must be a whole count over 359 samples"


@pytest.mark.slow
def test_compiled_segments_with_small_buckets_match_single_device_sgd(ray_cluster, tmp_path):
    """torch.compile per segment (segments end at 20 kB gradient buckets, so the convnet is cut into
    several compiled graphs whose gradients are all-reduced while the backward pass goes on) is still
    single-device SGD: dp=2, float64, 3 steps and an evaluation in eval mode."""
    steps = 3
    cfg = dp_config(tmp_path, 2, compile="on", bucket_mb=0.02, steps=steps, eval_every=steps,
                    out=str(tmp_path / "compiled"))
    summary = train_run(cfg, log=lambda *_: None)
    assert all(a["compiled"] for a in summary["actors"])
    got = torch.load(tmp_path / "compiled" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, steps), atol=1e-10)
    assert 0 <= summary["test_accuracy"] <= 1

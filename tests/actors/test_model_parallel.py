"""Filter split, pipeline stages, hybrids and the per-layer plan equal single-device SGD."""

from __future__ import annotations

import json

import pytest
import torch

from support.helpers import assert_same_state, reference_sgd, sgd_config, slow_among
from rayconv.config import Config
from rayconv.driver.job import train_run

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 4  # global batch 96 of the 1438 digits: 4 full steps


# (GPipe and interleaved 1F1B at 2 stages and 4 micro-batches, and the per-layer plan with micro-batches,
# are tests/actors/test_batchnorm.py's layouts, each checked against single-device SGD there; the per-layer
# plan
# over 4 is tests/actors/test_large_layouts.py's; an even filter split over 2 is dp2-fs2's, and interleaved
# with as many micro-batches as stages dp2-pp2-interleaved-v2's.)
LAYOUTS = {  # (the most actors first: a run that has no room beside the actors kept by the run before it
    # (--keep-actors-s) takes the first of them, so the 4 actors of the first run serve every run after it)
    "dp2-pp2-interleaved-v2": dict(dp=2, pp=2, virtual_stages=2, num_microbatches=2),
    "dp2-fs2": dict(dp=2, fs=2),
    "dp2-pp2": dict(dp=2, pp=2, num_microbatches=2, stages="8"),  # (a cut of CUTS)
    "pp2-fs2": dict(pp=2, fs=2, num_microbatches=2, schedule="gpipe"),
    "fs3-uneven": dict(fs=3),                      # 32/64/10 channels over 3 actors: 11,11,10 ...
    # each gather in 5 overlapped batch pieces (32 per replica: 7,7,6,6,6), channels uneven over 3 actors
    "fs3-overlapped-exchanges": dict(fs=3, exchange_chunks=5),
    "pp3-1f1b-m4": dict(pp=3, schedule="1f1b", num_microbatches=4),
    "pp3-interleaved-v2-m6": dict(pp=3, virtual_stages=2, num_microbatches=6),
    "fs2-batchnorm": dict(fs=2, model="convnet_bn"),  # batch norm over a channel slice is exact
    "fs2-two-column": dict(fs=2, model="convnet2col"),  # grouped conv2 needs no exchange
    "pp2-gpipe-m1": dict(pp=2, schedule="gpipe", num_microbatches=1, stages="4"),  # (a cut of CUTS)
    "pp2-1f1b-m3": dict(pp=2, schedule="1f1b", num_microbatches=3, stages="1"),  # (a cut of CUTS)
    # interleaved 1F1B: each stage holds non-adjacent model chunks (virtual stages s, s + P, ...)
    "pp2-interleaved-v3-m4": dict(pp=2, virtual_stages=3, num_microbatches=4),
    "plan-krizhevsky2014-dp2": dict(dp=2, plan="krizhevsky2014"),
    "pp2-balanced-by-time": dict(pp=2, balance="time", num_microbatches=2),  # stages cut by measured times
}


# summary.json's layout as reported, for two pipelines whose schedule (gpipe) and micro-batch count (3)
# are not the defaults (1f1b, 1): each field comes from the run's settings; the cuts are checked apart.
SUMMARY_LAYOUT = {
    "pp2-gpipe-m1": {"dp": 1, "pp": 2, "fs": 1, "world_size": 2, "plan": "none", "schedule": "gpipe",
                     "num_microbatches": 1, "virtual_stages": 1, "exchange_chunks": None},
    "pp2-1f1b-m3": {"dp": 1, "pp": 2, "fs": 1, "world_size": 2, "plan": "none", "schedule": "1f1b",
                    "num_microbatches": 3, "virtual_stages": 1, "exchange_chunks": None},
}


def layout_config(tmp_path, name, **kw) -> Config:
    return sgd_config(tmp_path, name, **{"steps": STEPS, "eval_every": STEPS, **kw})


@pytest.mark.parametrize("name", slow_among(LAYOUTS,
                                            {"fs3-uneven", "dp2-pp2-interleaved-v2", "pp2-balanced-by-time"}))
def test_layout_matches_single_device_sgd(ray_cluster, tmp_path, name):
    cfg = layout_config(tmp_path, name, **LAYOUTS[name])
    summary = train_run(cfg, log=lambda *_: None)
    assert summary["layout"]["world_size"] == cfg.dp * cfg.pp * cfg.fs
    if "stages" in LAYOUTS[name]:  # a cut given (CUTS): the stages are exactly those it makes
        cut = int(LAYOUTS[name]["stages"])
        assert [list(x) for x in summary["layout"]["stages"]] == [[0, cut], [cut, 12]]
    if name in SUMMARY_LAYOUT:
        stages = summary["layout"]["stages"]
        assert summary["layout"] == {**SUMMARY_LAYOUT[name], "stages": stages}
        assert len(stages) == 2 and stages[0][0] == 0
    got = torch.load(tmp_path / name / "model.pt", weights_only=True)
    want = reference_sgd(cfg, STEPS)
    assert_same_state(got, want, atol=1e-10)
    if cfg.balance == "time":  # the measured cut is written into the settings (a resume keeps it)
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert saved["stages"] and [list(x) for x in summary["layout"]["stages"]][1][0] == int(
            saved["stages"]
        )
    # Each actor holds about 1/K of the parameters under pp=K or fs=K.
    params = [a["parameters"] for a in summary["actors"]]
    total = sum(v.numel() for k, v in want.items() if "running" not in k and "num_batches" not in k)
    if cfg.plan == "none" and cfg.pp * cfg.fs > 1:
        assert sum(params) == total * cfg.dp
        assert max(params) < total


# Whatever cut balancing picks (by measured time it varies from run to run): a second stage that
# starts with a ReLU (1), with pooling (4, parameter-free), with flatten (8) or holds only the
# last layer (11) trains as single-device SGD does (cuts at a convolution are every other layout's).
# The cut changes only which layers each stage holds (its first layer, the activation shape on the
# wire, each stage's parameters), not the schedule's path: cuts 1, 4 and 8 are given to three pp=2
# layouts above (their runs check them), 11 runs here.
CUTS = (1, 4, 8, 11)


@pytest.mark.parametrize("cut", slow_among(
    [c for c in CUTS if not any(kw.get("stages") == str(c) for kw in LAYOUTS.values())], {11}))
def test_two_stage_cuts_match_single_device_sgd(ray_cluster, tmp_path, cut):
    """A two-stage pipeline cut at ``cut`` (1f1b, 2 micro-batches) trains as single-device SGD does."""
    cfg = layout_config(tmp_path, f"cut{cut}", pp=2, num_microbatches=2, stages=str(cut))
    summary = train_run(cfg, log=lambda *_: None)
    assert [list(x) for x in summary["layout"]["stages"]] == [[0, cut], [cut, 12]]
    got = torch.load(tmp_path / f"cut{cut}" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, STEPS), atol=1e-10)

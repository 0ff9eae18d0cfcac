"""A user's own ResNet-like ConvNet (tests/support/fixtures/blocks.py, not installed, given as
``--model path/to/blocks.py:blocknet``) cut into pipeline stages at its traced block boundaries
(rayconv.models.traced) trains as single-device SGD does: pp=2 under 1F1B with 4 micro-batches, and
dp2 x pp2; a model fx cannot trace trains data parallel and is refused for --pp. Filter split: a
user's plain ConvNet (functional pooling) under fs=2 equals single-device SGD; the ResNet-like one is
refused for --fs in one line naming its block. Batch norm under micro-batches: the reference is
``helpers.reference_microbatch_sgd`` (each micro-batch normalised by its own statistics, running statistics
once per step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.helpers import assert_same_state, reference_microbatch_sgd, reference_sgd, sgd_config, slow_among
from rayconv.driver.job import train_run
from rayconv.errors import LayoutError
from rayconv.data.registry import make_source
from rayconv.models import run_model, to_layers

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

FIXTURE = Path(__file__).parents[1] / "support" / "fixtures" / "blocks.py"
MODEL = f"{FIXTURE}:blocknet"
STEPS = 2

LAYOUTS = {   # (the larger first: the runs after it take two of its four actors)
    "dp2-pp2-1f1b-m4": dict(dp=2, pp=2, schedule="1f1b", num_microbatches=4),
    "pp2-1f1b-m4": dict(pp=2, schedule="1f1b", num_microbatches=4),
}


@pytest.mark.parametrize("name", slow_among(LAYOUTS, {"pp2-1f1b-m4", "dp2-pp2-1f1b-m4"}))
def test_user_model_pipeline_matches_single_device_sgd(ray_cluster, tmp_path, name):
    cfg = sgd_config(tmp_path, name, model=MODEL, steps=STEPS, eval_every=STEPS, **LAYOUTS[name])
    summary = train_run(cfg, log=lambda *_: None)
    layers = to_layers(run_model(cfg, make_source(cfg)))
    assert len(layers) > 2  # the traced view (a one-layer model is refused for --pp)
    (a, cut), (cut2, end) = [tuple(s) for s in summary["layout"]["stages"]]
    assert a == 0 and cut == cut2 and end == len(layers)
    got = torch.load(tmp_path / name / "model.pt", weights_only=True)
    want, _ = reference_microbatch_sgd(cfg, STEPS)
    assert_same_state(got, want, atol=1e-10)
    # model.pt loads into the user's own class.
    user = run_model(cfg, make_source(cfg)).double()
    assert type(user).__name__ == "BlockNet"
    user.load_state_dict(got, strict=True)


@pytest.mark.slow
def test_untraceable_model_trains_data_parallel_and_is_refused_for_pp(ray_cluster, tmp_path):
    """``branchy`` branches on the data: dp=2 equals single-device SGD; --pp 2 is refused in one line
    naming torch.fx's reason, before any actor starts."""
    cfg = sgd_config(tmp_path, "dp2", model=f"{FIXTURE}:branchy", dp=2, steps=STEPS, eval_every=STEPS)
    train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / "dp2" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, STEPS), atol=1e-10)
    cfg = sgd_config(tmp_path, "pp2", model=f"{FIXTURE}:branchy", pp=2, num_microbatches=2, steps=STEPS)
    with pytest.raises(LayoutError) as e:
        train_run(cfg, log=lambda *_: None)
    msg = str(e.value)
    assert "\n" not in msg and "cannot be cut into pipeline stages (torch.fx cannot trace its forward" in msg


def test_user_model_filter_split_or_refused(ray_cluster, tmp_path):
    cfg = sgd_config(tmp_path, "fs2", model=f"{FIXTURE}:plainnet", fs=2, steps=STEPS, eval_every=STEPS)
    train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / "fs2" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, STEPS), atol=1e-10)
    run_model(cfg, make_source(cfg)).double().load_state_dict(got, strict=True)   # the user's class
    cfg = sgd_config(tmp_path, "fs2-blocks", model=MODEL, fs=2, steps=STEPS)
    with pytest.raises(LayoutError) as e:
        train_run(cfg, log=lambda *_: None)
    assert (
        "\n" not in str(e.value)
        and "filter split cannot divide layer" in str(e.value)
        and "--fs 1" in str(e.value)
    )

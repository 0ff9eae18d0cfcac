"""4- and 8-actor layouts on CPU actors give the single-device result: the per-layer plan over 4, and
all three axes at once over 8 (data parallel, pipeline stages and filter split). Fewer-actor tests
cover each axis and pair of axes."""

from __future__ import annotations

import pytest
import torch
from conftest import local_ray

from support.helpers import assert_same_state, reference_sgd
from rayconv.config import Config
from rayconv.driver.job import train_run


@pytest.fixture(scope="module")
def ray_cluster8():
    """8 logical CPUs: one slot per actor of the 8-way layouts."""
    yield from local_ray(8)


LAYOUTS = {  # (the 8 actors first: the run of 4 after it has no room beside them, and takes the first 4)
    "dp2-pp2-fs2": dict(dp=2, pp=2, fs=2, num_microbatches=2),
    "plan4": dict(dp=4, plan="krizhevsky2014"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_large_layout_matches_single_device(ray_cluster8, tmp_path, name):
    kw = dict(model="convnet", data="digits", global_batch_size=96, steps=3, precision="fp64", device="cpu",
              progress=False, metrics=False, out=str(tmp_path / name))
    kw.update(LAYOUTS[name])
    cfg = Config(**kw).validate()
    summary = train_run(cfg, log=lambda *_: None)
    assert summary["layout"]["world_size"] == (4 if name == "plan4" else 8)
    got = torch.load(tmp_path / name / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, 3), atol=1e-10)

"""GPU checks (run on the lent GPU machine: ``pytest -m gpu``): NCCL inside the actors, each layout
equal to single-device SGD in float64, and short bf16 runs of AlexNet under filter split and pipeline."""

from __future__ import annotations

import pytest
import torch
from conftest import local_ray

from helpers import assert_same_state, reference_sgd
from rayconv.config import Config
from rayconv.driver import fit

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.fixture(scope="module")
def gpu_cluster():
    yield from local_ray(8, num_gpus=torch.cuda.device_count(), log_to_driver=True)


LAYOUTS = {
    "dp2": dict(dp=2),                                        # actors see all GPUs of the node (default)
    "dp2-one-gpu-visible": dict(dp=2, all_gpus_visible=False),
    "dp2-compiled": dict(dp=2, compile="on"),                  # compiled segments, float64
    "1gpu-cuda-graphs": dict(compile="on", cuda_graphs="on"),  # compiled, replayed as CUDA graphs
    "dp2-cuda-graphs": dict(dp=2, compile="on", cuda_graphs="on", bucket_mb=0.02),  # graphs between all-reduces
    "pp2-balanced-by-time": dict(pp=2, num_microbatches=2, balance="time"),
    "fs2": dict(fs=2),
    "pp2-1f1b": dict(pp=2, num_microbatches=2),
    "plan-dp2": dict(dp=2, plan="krizhevsky2014"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpu_layout_matches_single_device(gpu_cluster, tmp_path, name):
    kw = dict(model="convnet", data="digits", dp=1, global_batch_size=96, steps=4, precision="fp64",
              device="cuda", progress=False, out=str(tmp_path / name))
    kw.update(LAYOUTS[name])
    cfg = Config(**kw).validate()
    summary = fit(cfg, log=print)
    assert all(a["device"].startswith("cuda") for a in summary["actors"])
    got = torch.load(tmp_path / name / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, 4), atol=1e-8)


@pytest.mark.parametrize("layout", [dict(fs=2), dict(pp=2, num_microbatches=4), dict(dp=2, plan="krizhevsky2014"),
                                    dict(fs=2, compile="on"), dict(dp=2, plan="krizhevsky2014", compile="on")])
def test_alexnet_bf16_short_training(gpu_cluster, tmp_path, layout):
    kw = dict(model="alexnet", data="synthetic", image_size=224, synthetic_samples=2048, global_batch_size=256,
              steps=6, precision="bf16", device="cuda", dp=1, progress=False, out=str(tmp_path / "alex"), lr=0.01)
    kw.update(layout)
    cfg = Config(**kw)
    summary = fit(cfg.validate(), log=print)
    assert summary["final_train_loss"] > 0 and summary["steps"] == 6
    print("ALEXNET", layout, f"{summary['images_per_s']:.0f} images/s",
          [round(a["peak_gib"], 2) for a in summary["actors"]], "GiB peak")

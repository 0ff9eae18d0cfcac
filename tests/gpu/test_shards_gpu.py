"""GPU decode of prepared shards (run on the lent GPU machine: ``pytest -m gpu
tests/gpu/test_shards_gpu.py``): from the memory-mapped Arrow shards, nvJPEG + crop on the GPU takes the same
pixels as the CPU path, batches decoded ahead on the side stream equal batches decoded alone, and training on
shards under whole-step CUDA graphs equals eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import local_ray
from PIL import Image

from support.helpers import assert_same_state
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.data.shard_writer import prepare
from rayconv.data.shards import ShardSource

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 4)):
        for c in range(2):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(n):
                base = rng.integers(0, 255, (6, 8, 3)).astype(np.uint8)
                img = Image.fromarray(base).resize((80 + 4 * i, 60), Image.Resampling.BICUBIC)
                img.save(d / f"{i}.JPEG", quality=95)
    out = tmp_path_factory.mktemp("shards") / "s"
    prepare(str(root), str(out), size=64, shard_size=10, log=lambda *_: None, processes=2)
    # format 2: Arrow IPC files
    assert len(list(out.glob("*.arrow"))) == 6 and not list(out.glob("*.parquet"))
    return out


def test_gpu_decode_takes_the_cpu_paths_pixels(shards):
    idx = np.arange(0, 48, 3)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for split, epoch in (("train", 1), ("test", 0)):
        i = idx if split == "train" else np.arange(8)
        a = ShardSource(str(shards), 32, seed=0, workers=0, decode="gpu").images(split, i, gpu, epoch).cpu()
        b = ShardSource(str(shards), 32, seed=0, workers=0, decode="cpu").images(split, i, cpu, epoch)
        # (nvJPEG and libjpeg-turbo round differently: a few grey levels; a different crop or flip is far off)
        assert (a - b).abs().mean() < 0.05, split
        if split == "train":
            assert (a - b.flip(-1)).abs().mean() > 0.1


def test_batches_decoded_ahead_equal_batches_decoded_alone(shards):
    gpu = torch.device("cuda")
    batches = [np.arange(k, 48, 5) for k in range(5)]
    src = ShardSource(str(shards), 32, seed=0, workers=0, decode="gpu")
    src.prefetch("train", 2, batches)
    ahead = [src.images("train", b, gpu, 2).clone() for b in batches]
    torch.cuda.synchronize()
    for b, x in zip(batches, ahead):
        torch.testing.assert_close(ShardSource(str(shards), 32, seed=0, workers=0, decode="gpu")
                                   .images("train", b, gpu, 2), x, rtol=0, atol=0)


@pytest.fixture(scope="module")
def gpu_cluster():
    yield from local_ray(8, num_gpus=torch.cuda.device_count(), log_to_driver=True)


def test_training_on_shards_with_cuda_graphs_equals_eager(gpu_cluster, shards, tmp_path):
    runs = {}
    for graphs in ("on", "off"):
        cfg = Config(model="convnet", data="shards", data_dir=str(shards), image_size=32, dp=1,
                     global_batch_size=16, steps=6, precision="fp64", device="cuda", decode="gpu",
                     cuda_graphs=graphs, compile="off", data_on_device="off", progress=False,
                     out=str(tmp_path / graphs)).validate()
        train_run(cfg, log=print)
        runs[graphs] = torch.load(tmp_path / graphs / "model.pt", weights_only=True)
    assert_same_state(runs["on"], runs["off"], atol=1e-10)


def test_data_on_device_auto_counts_a_gpus_free_memory(gpu_cluster, shards, tmp_path):
    """--data-on-device auto on a GPU: the bound is a share of the GPU's free memory (measured in a task
    on one of the cluster's GPUs); the console says which was chosen and why, and the actors hold it."""
    lines: list[str] = []
    cfg = Config(model="convnet", data="shards", data_dir=str(shards), image_size=32, dp=1,
                 global_batch_size=16, steps=2, device="cuda", progress=False,
                 out=str(tmp_path / "run")).validate()
    train_run(cfg, log=lines.append)
    said = [x for x in lines
            if x.startswith("rayconv: --data-on-device auto: both splits held on the device (")]
    assert said and "of a GPU's free memory" in said[0] and "/ 1 actor holding a copy)" in said[0], lines[:6]
    assert any("data held on the device (--data-on-device)" in x for x in lines), lines[:6]

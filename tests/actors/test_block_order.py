"""``--shuffle block`` on a real local Ray cluster (float64, CPU): dp=1, dp=2 and pp=2 each equal
single-device SGD over the block order's global batches, so every layout sees the same samples at
every step; a run resumed mid-epoch equals the straight run bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from support.helpers import assert_same_state, reference_sgd, slow_among
from rayconv.config import Config
from rayconv.data.order import make_order
from rayconv.data.registry import make_source
from rayconv.data.source import Sharding
from rayconv.driver.job import train_run
from rayconv.run import main
from support.shard_folder import make_prepared

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)


@pytest.fixture(scope="module")
def prepared(ray_cluster, tmp_path_factory) -> Path:
    # 16 train images in 4 shards of 4 (cats and dogs mixed): with --shuffle-window 2, two windows.
    return make_prepared(tmp_path_factory.mktemp("block"))


def block_config(data_dir: Path, out: Path, **kw) -> Config:
    # Global batch 6: steps of 6, 6 and 4 per epoch; 5 steps cross an epoch boundary.
    base = dict(model="convnet", data="shards", data_dir=str(data_dir), image_size=32, dp=1,
                global_batch_size=6, steps=5, lr=0.05, momentum=0.9, weight_decay=5e-4, precision="fp64",
                device="cpu", progress=False, eval_every=5, loader_workers=1, decode="cpu", shuffle="block",
                shuffle_window=2, data_on_device="off", out=str(out))
    base.update(kw)
    return Config(**base).validate()


@pytest.mark.slow
def test_the_block_order_is_the_one_trained_on(prepared, tmp_path):
    """The reference follows the block order (windows of two shards), which differs from the exact one."""
    cfg = block_config(prepared, tmp_path / "x")
    source = make_source(cfg)
    sh = Sharding(source.train_size, 6, cfg.seed, make_order(cfg, source))
    windows = make_order(cfg, source).windows(0)
    first_window = set(np.concatenate([np.arange(4 * s, 4 * s + 4) for s in windows[0]]).tolist())
    assert set(sh.global_batch(0, 0).tolist()) <= first_window   # the first batch: samples of window 0 only
    exact = Sharding(source.train_size, 6, cfg.seed)
    assert not np.array_equal(sh.global_batch(0, 0), exact.global_batch(0, 0))


@pytest.mark.parametrize("layout",
                         slow_among([dict(dp=1), dict(dp=2), dict(dp=1, pp=2)], [dict(dp=1), dict(dp=2)]),
                         ids=["dp1", "dp2", "pp2"])
def test_every_layout_equals_single_device_sgd_in_block_order(ray_cluster, prepared, tmp_path, layout):
    extra = dict(checkpoint_every=2, keep_checkpoints=0) if layout.get("dp") == 2 else {}
    cfg = block_config(prepared, tmp_path / "a", **layout, **extra)
    train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, 5), atol=1e-10)
    if extra:  # resumed mid-epoch (step 2 of 3) on another loader worker count: bit-identical
        assert main(["--resume", str(tmp_path / "a" / "checkpoints" / "step-2"), "--out", str(tmp_path / "b"),
                     "--loader-workers", "0"]) == 0
        torch.testing.assert_close(torch.load(tmp_path / "b" / "model.pt", weights_only=True), got, rtol=0,
                                   atol=0)

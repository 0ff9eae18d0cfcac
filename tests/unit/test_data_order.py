"""rayconv.data.order: the exact and the block (windows of shards) epoch orders, and Sharding over them."""

from __future__ import annotations

import numpy as np
import pytest

from rayconv.config import Config
from rayconv.data.order import BlockOrder, ExactOrder, make_order
from rayconv.data.source import Sharding
from rayconv.errors import ConfigError

ROWS = (7, 7, 7, 7, 7, 5, 7, 7, 7, 3)   # 10 shards, uneven last ones: 64 samples


def shard_of(rows) -> np.ndarray:
    return np.repeat(np.arange(len(rows)), rows)


@pytest.mark.parametrize("window", [1, 3, 4, 10, 50])
def test_block_order_is_a_permutation_with_each_window_contiguous(window):
    order = BlockOrder(ROWS, window, seed=2)
    owner = shard_of(ROWS)
    for epoch in range(3):
        got = order.epoch_order(epoch)
        assert sorted(got.tolist()) == list(range(sum(ROWS)))
        windows = order.windows(epoch)
        assert sorted(np.concatenate(windows).tolist()) == list(range(len(ROWS)))   # shards permuted
        assert all(len(w) == window for w in windows[:-1]) and 1 <= len(windows[-1]) <= window
        pos = 0
        for w in windows:  # the window's samples, and only those, next in the order
            n = sum(ROWS[s] for s in w)
            assert set(owner[got[pos:pos + n]]) == set(w.tolist())
            pos += n


def test_block_order_depends_on_seed_and_epoch_only():
    a, b = BlockOrder(ROWS, 3, seed=1), BlockOrder(ROWS, 3, seed=1)
    assert np.array_equal(a.epoch_order(4), b.epoch_order(4))
    assert not np.array_equal(a.epoch_order(4), a.epoch_order(5))
    assert not np.array_equal(a.epoch_order(4), BlockOrder(ROWS, 3, seed=2).epoch_order(4))
    # The samples within a window are shuffled too, not kept in row order.
    assert not all(np.all(np.diff(a.epoch_order(0)[i:i + 7]) == 1) for i in range(0, 64, 7))


def test_exact_order_is_todays_permutation():
    assert np.array_equal(ExactOrder(500, 3).epoch_order(2),
                          np.random.default_rng([3, 2, 0x5EED]).permutation(500))
    a = Sharding(500, 32, seed=3)
    assert np.array_equal(a.global_batch(2, 1), ExactOrder(500, 3).epoch_order(2)[32:64])


def test_sharding_over_block_order_splits_consecutive_chunks():
    order = BlockOrder(ROWS, 2, seed=0)
    epoch = order.epoch_order(1)
    for dp in (1, 2, 3):
        sh = Sharding(64, 12, seed=0, order=order)
        assert sh.steps_per_epoch == 6
        for s in range(6):
            parts = [sh.replica_batch(1, s, r, dp)[0] for r in range(dp)]
            assert np.array_equal(np.concatenate(parts), epoch[12 * s:12 * s + 12])


class _Prepared:
    train_size = sum(ROWS)
    manifest = {"splits": {"train": {"shards": [{"file": f"train-{i:05d}.arrow", "rows": r, "bytes": 1,
                                                 "sha256": ""} for i, r in enumerate(ROWS)]}}}


def test_make_order_reads_the_train_shards_and_refuses_other_data():
    cfg = Config(data="shards", data_dir="x", shuffle="block", shuffle_window=4, seed=7).validate()
    assert make_order(cfg, _Prepared()) == BlockOrder(ROWS, 4, 7)
    assert make_order(Config(data="shards", data_dir="x").validate(), _Prepared()) is None
    with pytest.raises(ConfigError, match="--data shards"):
        Config(data="digits", shuffle="block").validate()
    with pytest.raises(ConfigError, match="has no shards"):
        make_order(cfg, object())

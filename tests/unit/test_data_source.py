"""rayconv.data.source: the per-epoch shuffle and its split over data-parallel replicas (Sharding), the
test-set shards; rayconv.data.synthetic's images in the dtype asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayconv.data import source as data_mod
from rayconv.data.source import Sharding
from rayconv.data.synthetic import SyntheticSource


SHARDINGS = [(1438, 102, 4), (1438, 64, 2), (10, 3, 3), (7, 7, 2), (5, 8, 2), (100, 10, 1), (9, 4, 4)]


@pytest.mark.parametrize("n, batch, dp", SHARDINGS)
def test_each_epoch_covers_every_train_sample_once(n, batch, dp):
    sh = Sharding(n, batch, seed=3)
    assert sh.steps_per_epoch == -(-n // batch)
    for epoch in range(3):
        batches = [sh.global_batch(epoch, s) for s in range(sh.steps_per_epoch)]
        assert all(len(b) == batch for b in batches[:-1])
        assert 1 <= len(batches[-1]) <= batch
        assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(n))


@pytest.mark.parametrize("n, batch, dp", SHARDINGS)
def test_replica_slices_split_the_global_batch(n, batch, dp):
    sh = Sharding(n, batch, seed=5)
    for epoch in range(2):
        for s in range(sh.steps_per_epoch):
            whole = sh.global_batch(epoch, s)
            parts = [sh.replica_batch(epoch, s, r, dp) for r in range(dp)]
            assert all(count == len(whole) for _, count in parts)
            idx = [p for p, _ in parts]
            assert np.array_equal(np.concatenate(idx), whole)         # disjoint, cover, in order
            sizes = [len(p) for p in idx]
            assert max(sizes) - min(sizes) <= 1


def test_sharding_is_deterministic_and_depends_on_seed_and_epoch():
    a, b = Sharding(500, 32, seed=1), Sharding(500, 32, seed=1)
    for epoch, s, r in [(0, 0, 0), (0, 15, 3), (2, 7, 1)]:
        assert np.array_equal(a.replica_batch(epoch, s, r, 4)[0], b.replica_batch(epoch, s, r, 4)[0])
    assert not np.array_equal(a.global_batch(0, 0), a.global_batch(1, 0))                        # reshuffled
    assert not np.array_equal(a.global_batch(0, 0), Sharding(500, 32, seed=2).global_batch(0, 0))


@pytest.mark.parametrize("n, dp", [(359, 4), (360, 4), (6, 2), (3, 4), (1, 1), (17, 5)])
def test_replica_test_indices_cover_the_test_set_once(n, dp):
    shares = [data_mod.replica_test_indices(n, dp, r) for r in range(dp)]
    assert np.array_equal(np.concatenate(shares), np.arange(n))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_synthetic_images_are_made_in_the_dtype_asked_for():
    src = SyntheticSource(num_classes=10, image_size=8, train_size=32, seed=0)
    idx = np.arange(4)
    x32, x16 = src.images("train", idx, torch.device("cpu")), src.images("train", idx, torch.device("cpu"),
                                                                           dtype=torch.bfloat16)
    assert (
        x32.dtype == torch.float32 and x16.dtype == torch.bfloat16 and x16.shape == x32.shape == (4, 3, 8, 8)
    )
    assert torch.equal(src.images("train", idx, torch.device("cpu"), dtype=torch.bfloat16), x16)  # same seed

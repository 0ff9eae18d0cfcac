"""The device-side augmentation replayed as CUDA graphs (``rayconv/data/augment_graph.py``; run on the
lent GPU machine: ``pytest -m gpu tests/gpu/test_augment_graph_gpu.py``): for raw shards streamed and
for data held on the device, every batch (the first of a shape eager, the second captured, the rest
replayed; a new epoch's table; a partial batch; the test split) equals the eager augmentation to the
bit, and a batch returned earlier is not overwritten by later ones; streamed raw shards' labels copied
with the pixels (``device_labels``) are the batch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.image_folder import write_folder
from rayconv import prepare as prep
from rayconv.config import Config
from rayconv.data.raw_shards import RawShardSource
from rayconv.data.registry import make_source
from rayconv.data.shard_writer import on_processes
from rayconv.data.small import HeldSource
from rayconv.data.source import to_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")]
SIZE = 32
GPU = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    # 24 train, 8 val
    root = write_folder(tmp_path_factory.mktemp("src") / "images", ".png", train=12, val=4)
    out = tmp_path_factory.mktemp("prepared") / "raw"
    mp = pytest.MonkeyPatch()
    mp.setattr(prep, "_on_ray", lambda args, address: on_processes(args, 1))
    try:
        assert prep.main([str(root), "--out", str(out), "--size", str(SIZE), "--shard-size", "5",
                          "--encoding", "raw"]) == 0
    finally:
        mp.undo()
    return out


def _eager(source, split: str, idx: np.ndarray, epoch: int, dtype):
    """The batch through ``_augment`` directly (no graph), as off the GPU."""
    train = split == "train"
    params = source._epoch_params(GPU, epoch) if train else {}
    rows = to_device(torch.from_numpy(idx), GPU)
    if isinstance(source, RawShardSource):
        pixels = to_device(source.uint8(split, idx), GPU)
        return source._augment((train, dtype, epoch), pixels=pixels, **({"rows": rows} if params else {}),
                               **params)
    stored = source._on(GPU)
    return source._augment((split, train, dtype, epoch), images=stored[split], mean=stored["mean"],
                           std=stored["std"], rows=rows, **params)


@pytest.mark.parametrize("on_device", ["off", "on"])
def test_replayed_batches_equal_eager_ones_to_the_bit(raw, on_device):
    cfg = Config(data="shards", data_dir=str(raw), image_size=SIZE, device="cuda", augment="pad-crop",
                 random_erase=0.5, loader_workers=0, data_on_device=on_device).validate()
    source = make_source(cfg)
    assert isinstance(source, RawShardSource if on_device == "off" else HeldSource)
    rng = np.random.default_rng(1)
    full = [rng.permutation(24)[:8] for _ in range(4)] + [np.arange(5)]     # 4 full batches, 1 partial
    kept = []
    for epoch in (1, 2):
        source.prefetch("train", epoch, full)
        for b in full:
            x = source.images("train", b, GPU, epoch=epoch, dtype=torch.bfloat16)
            torch.testing.assert_close(x, _eager(source, "train", b, epoch, torch.bfloat16), rtol=0, atol=0)
            made = source.device_labels("train", b, GPU)
            if on_device == "off":   # (raw shards copy the batch's labels with its pixels)
                assert made is not None and made.is_cuda and torch.equal(made.cpu(),
                                                                         source.labels("train", b))
                assert source.device_labels("train", b, GPU) is None   # (given once)
            kept.append((b, epoch, x))
    assert source._graphs is not None and source._graphs.captures   # (batches did replay)
    if on_device == "off":   # (the reader process's ring is page-locked here: its copies are asynchronous)
        assert source._reader.rings["train"].registered
    for b, epoch, x in kept[:3]:   # (earlier results are copies, not the graph's buffer)
        torch.testing.assert_close(x, _eager(source, "train", b, epoch, torch.bfloat16), rtol=0, atol=0)
    test = np.arange(8)
    for _ in range(3):
        torch.testing.assert_close(source.images("test", test, GPU), _eager(source, "test", test, 0, None),
                                   rtol=0, atol=0)

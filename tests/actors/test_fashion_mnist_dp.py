"""--data fashion-mnist on a real local Ray cluster: dp=2 with the on-device crops and flips (and
TrivialAugmentWide with random erasing) equals
single-device SGD on the same augmented batches, parameter for parameter. The four idx files are
written here (256 train and 32 test images, so that the final evaluation is quick); the real files'
reading is tests/unit/test_data_fashion_mnist.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.helpers import assert_same_state, reference_sgd, slow_among
from rayconv.config import Config
from rayconv.data.fashion_mnist import FILES
from rayconv.driver.job import train_run
from rayconv.models import ConvNet

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 2


def write_fashion_mnist(root, n_train: int, n_test: int) -> None:
    """The four idx files (plain) of random 28x28 uint8 images with labels 0..9 in turn."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        for name, array in zip(FILES[split], (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                                               (np.arange(n) % 10).astype(np.uint8))):
            head = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
            (root / name).write_bytes(head + array.tobytes())


@pytest.mark.parametrize("augmentation", slow_among([{}, dict(auto_augment="ta_wide", random_erase=0.5)],
                                                    [dict(auto_augment="ta_wide", random_erase=0.5)]))
def test_dp2_on_fashion_mnist_matches_single_device_sgd(ray_cluster, tmp_path, augmentation):
    write_fashion_mnist(tmp_path, 256, 32)
    cfg = Config(model="convnet", data="fashion-mnist", data_dir=str(tmp_path), dp=2, global_batch_size=64,
                 **augmentation,
                 steps=STEPS, lr=0.05, momentum=0.9, weight_decay=5e-4, precision="fp64", device="cpu",
                 progress=False, out=str(tmp_path / "run")).validate()
    train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, STEPS), atol=1e-10)
    torch.manual_seed(cfg.seed)
    init = ConvNet(1, 10).double().state_dict()     # in_channels=1: the grayscale images
    assert max((got[k].double() - init[k]).abs().max().item() for k in init) > 1e-4

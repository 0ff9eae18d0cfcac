"""--augment, --random-erase, --channels and small images (rayconv/data/augment.py, on_device.py,
registry.py, imagefolder.py, rayconv/models), without Ray: a sample's augmentation depends on (seed,
epoch, index) only, really changes the image, and follows torchvision's semantics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import functional as TVF

from rayconv.config import Config
from rayconv.data.augment import erase, erase_params, resized_crop_flip, resized_crop_params
from rayconv.data.fashion_mnist import FILES
from rayconv.data.imagefolder import ImageFolderSource
from rayconv.data.on_device import pad_for
from rayconv.data.registry import make_source
from rayconv.errors import ConfigError
from rayconv.models import build_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    """The four Fashion-MNIST idx files holding 48 train and 8 test random 28x28 images."""
    root = tmp_path_factory.mktemp("fmnist")
    rng = np.random.default_rng(1)
    for split, n in (("train", 48), ("test", 8)):
        for name, array in zip(FILES[split], (rng.integers(1, 256, (n, 28, 28), dtype=np.uint8),
                                               (np.arange(n) % 10).astype(np.uint8))):
            head = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
            (root / name).write_bytes(head + array.tobytes())
    return root


def _source(root: Path, **kw):
    return make_source(Config(data="fashion-mnist", data_dir=str(root), **kw).validate())


@pytest.mark.parametrize("kw", [dict(augment="resized-crop"), dict(augment="pad-crop", random_erase=0.5),
                                dict(augment="resized-crop", random_erase=1.0, image_size=40),
                                dict(augment="pad-crop", auto_augment="imagenet"),
                                dict(augment="none", auto_augment="ta_wide", random_erase=0.5)])
def test_augmentation_does_not_depend_on_the_batch_or_the_source_instance(fmnist, kw):
    src = _source(fmnist, seed=5, **kw)
    idx = np.array([3, 40, 7, 19, 0, 33, 12, 47])
    whole = src.images("train", idx, CPU, epoch=1)
    for part in (idx[:3], idx[3:], idx[[5, 2]]):
        rows = [list(idx).index(i) for i in part]
        assert torch.equal(src.images("train", part, CPU, epoch=1), whole[rows])
    assert torch.equal(_source(fmnist, seed=5, **kw).images("train", idx[4:6], CPU, epoch=1), whole[4:6])
    assert not torch.equal(src.images("train", idx, CPU, epoch=2), whole)          # new epoch, new draws
    plain = _source(fmnist, seed=5, augment="none", **{k: v for k, v in kw.items() if k == "image_size"})
    assert not torch.equal(plain.images("train", idx, CPU, epoch=1), whole)        # really augmented
    # as is
    assert torch.equal(src.images("test", np.arange(8), CPU), plain.images("test", np.arange(8), CPU))


@pytest.mark.parametrize("policy", ["imagenet", "cifar10", "svhn", "ra", "ta_wide"])
def test_auto_augment_is_torchvisions_policy_per_group_and_keeps_the_global_rng(policy):
    from rayconv.data import auto_augment as aa
    from rayconv.data.source import stable_seed

    x = torch.randint(0, 256, (24, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    groups = torch.tensor([0, 1, 2, 3] * 6)
    transform = aa.make_transform(policy)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    out = aa.apply(x, groups, transform, seed=7, epoch=2)
    assert torch.equal(torch.get_rng_state(), before)                  # the model's RNG (dropout) untouched
    for g in range(4):
        torch.manual_seed(stable_seed(7, "auto-augment", 2, g))
        assert torch.equal(out[groups == g], transform(x[groups == g]))    # the v2 transform's own draw
    assert not torch.equal(out, x)
    with pytest.raises(ValueError, match="choose one of"):
        aa.make_transform("autoaugment")


def test_auto_augment_needs_data_it_augments_and_a_known_policy():
    with pytest.raises(ConfigError, match="--auto-augment augments fashion-mnist, imagefolder and shards"):
        Config(auto_augment="ra").validate()                            # the digits are never augmented
    with pytest.raises(SystemExit):
        from rayconv.flags import parse_args
        parse_args(["--data", "fashion-mnist", "--auto-augment", "v1"])


def test_resized_crop_is_torchvisions_crop_then_resize():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 2, 20, 20), generator=g, dtype=torch.uint8)
    boxes, flips = resized_crop_params(64, 20, 20, g)
    top, left, h, w = boxes.unbind(1)
    area = (h * w).double() / 400
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 20).all() and (left + w <= 20).all()
    assert area.min() >= 0.06 and area.max() <= 1 and 0 < flips.sum() < 64
    assert len(set(map(tuple, boxes.tolist()))) > 50
    got = resized_crop_flip(x, boxes, flips)
    for i in range(64):
        want = TVF.resized_crop(x[i], *boxes[i].tolist(), [20, 20], antialias=False)
        want = TVF.horizontal_flip(want) if flips[i] else want
        assert (got[i].int() - want.int()).abs().max() <= 1, i   # (rounding of the two bilinear paths)


def test_random_erasing_boxes_are_torchvisions():
    g = torch.Generator().manual_seed(3)
    boxes = erase_params(4000, 28, 28, 0.25, g)
    on = boxes[:, 2] > 0
    assert 0.2 < on.double().mean() < 0.3
    top, left, h, w = boxes[on].unbind(1)
    assert (top + h <= 28).all() and (left + w <= 28).all() and (h < 28).all() and (w < 28).all()
    area = (h * w).double() / 784
    assert area.min() >= 0.015 and area.max() <= 0.36
    x = torch.ones(2, 3, 6, 6)
    out = erase(x, torch.tensor([[1, 2, 3, 2], [0, 0, 0, 0]]))
    assert torch.equal(out[1], x[1]) and out[0, :, 1:4, 2:4].abs().sum() == 0 and out[0].sum() == 108 - 18


def test_the_pad_scales_with_the_image_and_fashion_mnist_honours_image_size(fmnist):
    assert [pad_for(s) for s in (8, 16, 28, 32, 64, 224)] == [1, 2, 4, 4, 8, 28]
    src = _source(fmnist, image_size=64)
    assert src.sample_shape == (1, 64, 64) and src.pad == 8 and src.augment == "pad-crop"
    assert src.images("train", np.arange(4), CPU).shape == (4, 1, 64, 64)
    assert _source(fmnist, image_size=96).augment == "resized-crop"          # auto above 64 pixels
    small = _source(fmnist, image_size=16)
    assert small.sample_shape == (1, 16, 16) and small.pad == 2
    assert make_source(Config(data="digits", augment="none").validate()).augmentation == "none"
    with pytest.raises(ConfigError, match="--augment pad-crop augments .* not --data digits"):
        Config(data="digits", augment="pad-crop").validate()


def test_grey_data_is_expanded_for_torchvision_models(fmnist):
    grey = _source(fmnist)
    assert grey.sample_shape == (1, 28, 28) and "expand" not in grey.describe()
    rgb = _source(fmnist, model="resnet18")
    x = rgb.images("train", np.arange(5), CPU, epoch=0)
    assert rgb.sample_shape == (3, 28, 28) and x.shape == (5, 3, 28, 28) and x.stride(1) == 0   # a view
    assert torch.equal(x[:, 0], x[:, 2]) and torch.equal(x[:, :1], grey.images("train", np.arange(5), CPU))
    assert "3 equal channels" in rgb.describe() and "fashion-mnist" in rgb.describe()
    assert _source(fmnist, channels=3).sample_shape == (3, 28, 28)                 # asked for by convnet
    assert _source(fmnist, model="resnet18", channels=1).sample_shape == (1, 28, 28)
    digits = make_source(Config(model="resnet18").validate())
    assert digits.sample_shape == (3, 8, 8) and digits.images("test", np.arange(2), CPU).shape == (2, 3, 8, 8)


def test_channels_1_of_colour_data_is_refused_in_one_line():
    src = make_source(Config(data="synthetic", synthetic_samples=16, image_size=32).validate())
    with pytest.raises(ConfigError) as e:
        src.set_channels(1)
    assert "\n" not in str(e.value) and "--channels 1" in str(e.value)


def test_small_images_are_accepted_where_the_model_takes_them():
    assert build_model("convnet", 10, 1, 8)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert build_model("resnet18", 10, 3, 28)(torch.zeros(2, 3, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError, match="--model alexnet cannot take 28x28 images"):
        build_model("alexnet", 10, 3, 28)


def test_zero_init_residual_where_the_builder_takes_it():
    model = build_model("resnet18", 10, 3, 32, zero_init_residual=True)
    assert all(b.bn2.weight.abs().sum() == 0 for b in model.layer1)
    assert build_model("resnet18", 10, 3, 32).layer1[0].bn2.weight.abs().sum() > 0
    for name in ("vgg11", "convnet"):
        with pytest.raises(ConfigError, match="--zero-init-residual") as e:
            build_model(name, 10, 3, 32, zero_init_residual=True)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("augment", ["pad-crop", "none", "resized-crop"])
def test_imagefolder_honours_augment_and_erasing(tmp_path, augment):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3),
                                             dtype=np.uint8)).save(tmp_path / split / cls / f"{i}.png")
    aa = dict(auto_augment="ra") if augment == "none" else {}
    src = ImageFolderSource(str(tmp_path), 32, seed=0, workers=0, augment=augment, random_erase=1.0, **aa)
    x = src.images("train", np.arange(4), CPU)
    again = ImageFolderSource(str(tmp_path), 32, seed=0, workers=0, augment=augment, random_erase=1.0, **aa)
    assert x.shape == (4, 3, 32, 32) and torch.equal(again.images("train", np.arange(4)[2:], CPU), x[2:])
    assert ((x == 0).all(1).sum((1, 2)) > 0).all()                     # every image has an erased patch
    plain = ImageFolderSource(str(tmp_path), 32, seed=0, workers=0, augment="none")
    first = plain.images("train", np.arange(4), CPU)
    assert torch.equal(plain.images("train", np.arange(4), CPU, epoch=3), first)   # none: no randomness
    if augment != "none":
        assert not torch.equal(ImageFolderSource(str(tmp_path), 32, seed=0, workers=0, augment=augment)
                               .images("train", np.arange(4), CPU), first)
    assert "random erasing p=1" in src.describe() and ("auto-augment ra" in src.describe()) == bool(aa)


def test_shards_honour_augment_and_erasing(tmp_path):
    from PIL import Image

    from rayconv.data.shard_writer import prepare
    from rayconv.data.shards import ShardSource

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / "src" / split / cls).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(
                    tmp_path / "src" / split / cls / f"{i}.JPEG", quality=95)
    prepare(str(tmp_path / "src"), str(tmp_path / "shards"), size=40, shard_size=4, log=lambda *_: None,
            processes=1)
    make = lambda augment, erase=0.0: ShardSource(  # noqa: E731
        str(tmp_path / "shards"), 32, 0, 0, "cpu", augment, erase)
    idx = np.arange(4)
    none = make("none").images("train", idx, CPU)
    assert torch.equal(none, make("none").images("train", idx, CPU, epoch=2))       # no randomness
    for augment in ("pad-crop", "resized-crop"):
        x = make(augment).images("train", idx, CPU)
        assert x.shape == (4, 3, 32, 32) and not torch.equal(x, none)
        assert torch.equal(make(augment).images("train", idx[2:], CPU), x[2:])      # per sample
    erased = make("none", 1.0).images("train", idx, CPU)
    assert ((erased == 0).all(1).sum((1, 2)) > 0).all() \
        and "random erasing p=1" in make("none", 1.0).describe()
    assert torch.equal(make("none", 1.0).images("train", idx[1:3], CPU), erased[1:3])
    policy = lambda: ShardSource(  # noqa: E731
        str(tmp_path / "shards"), 32, 0, 0, "cpu", "none", auto_augment="ta_wide")
    x = policy().images("train", idx, CPU, epoch=1)
    assert not torch.equal(x, none) \
        and torch.equal(policy().images("train", idx[[3, 1]], CPU, epoch=1), x[[3, 1]])
    assert "auto-augment ta_wide" in policy().describe()


def test_bn_momentum_sets_every_batch_norm_of_the_run_model():
    from types import SimpleNamespace

    from rayconv.models import run_model

    source = SimpleNamespace(num_classes=10, sample_shape=(3, 32, 32))
    model = run_model(Config(model="resnet18", bn_momentum=0.01).validate(), source)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 20 and {m.momentum for m in norms} == {0.01}
    assert {m.momentum for m in run_model(Config(model="resnet18").validate(), source).modules()
            if isinstance(m, torch.nn.BatchNorm2d)} == {0.1}   # (left out: torch's own)
    x = torch.randn(4, 3, 32, 32) + 2.0
    model.train()(x)   # the running mean moves 0.01 of the way from 0 to the batch's mean
    torch.testing.assert_close(model.bn1.running_mean, 0.01 * model.conv1(x).mean((0, 2, 3)),
                               rtol=1e-4, atol=1e-6)

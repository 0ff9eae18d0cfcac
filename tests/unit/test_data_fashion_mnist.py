"""--data fashion-mnist and the batched on-device augmentation (rayconv/data/fashion_mnist.py,
on_device.py, augment.py), without Ray: the real files where Debian's package put them, small idx
files written here for the rest."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayconv.config import Config
from rayconv.data.augment import normalize, random_crop_flip
from rayconv.data import fashion_mnist
from rayconv.data.fashion_mnist import (
    DEBIAN_DIR,
    FILES,
    PAD,
    HeaderSource,
    fashion_mnist_arrays,
    load_fashion_mnist,
    read_ahead,
)
from rayconv.data.on_device import OnDeviceSource, channel_stats
from rayconv.data.registry import check_source, make_source
from rayconv.errors import DataError

CPU = torch.device("cpu")
real = pytest.mark.skipif(not Path(DEBIAN_DIR).is_dir(), reason="apt-get install dataset-fashion-mnist")


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """``array`` (uint8, 1 or 3 dims) as an idx file, gzipped when ``gz``."""
    head = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    (gzip.open if gz else open)(str(path) + (".gz" if gz else ""), "wb").write(head + array.tobytes())


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A folder of the four idx files holding 40 train and 10 test random 28x28 images (train gzipped,
    test plain, as either may be)."""
    root = tmp_path_factory.mktemp("fmnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("test", 10)):
        images, labels = FILES[split]
        write_idx(root / images, rng.integers(1, 256, (n, 28, 28), dtype=np.uint8), gz=split == "train")
        write_idx(root / labels, (np.arange(n) % 10).astype(np.uint8), gz=split == "train")
    return root


@real
def test_the_real_files_give_the_published_split():
    arrays = fashion_mnist_arrays()
    (x, y), (xt, yt) = arrays["train"], arrays["test"]
    assert x.shape == (60000, 1, 28, 28) and xt.shape == (10000, 1, 28, 28)
    assert x.dtype == xt.dtype == np.uint8 and y.dtype == yt.dtype == np.int64
    assert np.bincount(y).tolist() == [6000] * 10 and np.bincount(yt).tolist() == [1000] * 10
    src = make_source(Config(data="fashion-mnist").validate())
    assert isinstance(src, OnDeviceSource)
    assert (src.num_classes, src.sample_shape, src.train_size, src.test_size) == (10, (1, 28, 28), 60000,
                                                                                  10000)
    assert src.mean[0] == pytest.approx(0.2860, abs=1e-4) and src.std[0] == pytest.approx(0.3530, abs=1e-4)
    idx = np.array([0, 9999, 7])
    got = src.images("test", idx, CPU)
    assert got.dtype == torch.float32 and got.shape == (3, 1, 28, 28)
    assert torch.equal(got, normalize(torch.from_numpy(xt[idx]), src.mean, src.std))   # test: not augmented
    assert torch.equal(src.labels("train", idx), torch.from_numpy(y[idx]))


def metadata(src) -> tuple:
    return (src.name, src.num_classes, src.sample_shape, src.expanded_from, src.train_size, src.test_size,
            src.augmentation, src.describe())


@real
def test_the_drivers_check_reads_the_headers_and_describes_the_data_as_the_full_load():
    """The driver's check (``check_source``) describes the files as the actors' full load does, from the
    idx headers and the labels: no image file read whole (nothing in the files-read cache)."""
    cfg = Config(data="fashion-mnist").validate()
    fashion_mnist._READ.clear()
    seen = check_source(cfg)
    assert isinstance(seen, HeaderSource) and not fashion_mnist._READ
    assert fashion_mnist.fashion_mnist_meta() == {"train": (60000, 28, 28), "test": (10000, 28, 28)}
    assert metadata(seen) == metadata(make_source(cfg))


@pytest.mark.parametrize("flags", [{}, {"image_size": 32, "channels": 3, "val_split": 0.1},
                                   {"augment": "none", "random_erase": 0.25, "auto_augment": "ta_wide"}])
def test_the_header_source_gives_what_the_actors_source_gives(small, flags):
    """Sizes, shape, channels, augmentation in words, and (for --log-images' first batch) the images and
    labels themselves, read when first asked for."""
    cfg = Config(data="fashion-mnist", data_dir=str(small), global_batch_size=8, **flags).validate()
    seen, full = check_source(cfg), make_source(cfg)
    assert isinstance(seen, HeaderSource) and metadata(seen) == metadata(full)
    idx = np.array([3, 0, 31])
    split = "val" if cfg.val_split else "train"
    assert torch.equal(seen.images(split, idx, CPU, epoch=1), full.images(split, idx, CPU, epoch=1))
    assert torch.equal(seen.labels(split, idx), full.labels(split, idx))


@pytest.mark.parametrize("images", [FILES["train"][0] + ".gz", FILES["test"][0]])
def test_a_truncated_image_file_is_refused_by_the_check_as_by_the_load(small, tmp_path, images):
    for f in small.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = (tmp_path / images).read_bytes()
    (tmp_path / images).write_bytes(data[:-100])
    cfg = Config(data="fashion-mnist", data_dir=str(tmp_path)).validate()
    with pytest.raises(DataError) as checked:
        check_source(cfg)
    with pytest.raises(DataError) as loaded:
        fashion_mnist_arrays(str(tmp_path))
    msg = str(checked.value)
    assert msg == str(loaded.value) and "\n" not in msg and images in msg


def test_missing_files_name_the_package_in_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        make_source(Config(data="fashion-mnist", data_dir=str(tmp_path)).validate())
    msg = str(e.value)
    assert "\n" not in msg and "apt-get install dataset-fashion-mnist" in msg and "--data-dir" in msg
    assert "t10k-labels-idx1-ubyte" in msg and str(tmp_path) in msg


def test_a_malformed_file_is_named(small, tmp_path):
    for f in small.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x01\0\0\0\x09" + bytes(3))  # 9 said, 3 there
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte is not an idx file"):
        fashion_mnist_arrays(str(tmp_path))


def test_files_read_ahead_are_read_once_and_again_when_they_change(small, tmp_path):
    """An actor reads its files on a thread (``read_ahead``) while it imports; its build's source then
    takes those arrays and statistics (the same objects: no second read); a file changed since is read
    anew; a folder that lacks the files is reported by the load, not by the read-ahead."""
    for f in small.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    read_ahead(str(tmp_path))
    first = fashion_mnist_arrays(str(tmp_path))
    src = load_fashion_mnist(str(tmp_path), seed=0)
    assert np.shares_memory(src.host["train"].numpy(), first["train"][0])
    assert fashion_mnist_arrays(str(tmp_path))["train"][0] is first["train"][0]
    assert (src.mean, src.std) == tuple(map(list, channel_stats(first["train"][0])))
    images = FILES["test"][0]
    write_idx(tmp_path / "replacement", np.full((10, 28, 28), 7, dtype=np.uint8), gz=False)
    (tmp_path / "replacement").replace(tmp_path / images)   # (as a copy or a download replaces a file)
    again = fashion_mnist_arrays(str(tmp_path))
    assert again["test"][0] is not first["test"][0] and (again["test"][0] == 7).all()
    read_ahead(str(tmp_path / "absent"))   # (nothing raised here)
    with pytest.raises(DataError, match="lacks"):
        load_fashion_mnist(str(tmp_path / "absent"), seed=0)


def test_plain_and_gzipped_files_read_alike(small):
    src = load_fashion_mnist(str(small), seed=0)
    assert (src.train_size, src.test_size, src.sample_shape) == (40, 10, (1, 28, 28))
    assert src.labels("train", np.arange(12)).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_a_samples_augmentation_does_not_depend_on_its_batch(small):
    src = load_fashion_mnist(str(small), seed=3)
    idx = np.array([5, 17, 2, 39, 11, 0, 23, 8])
    eight = src.images("train", idx, CPU, epoch=2)
    three = src.images("train", idx[[6, 1, 3]], CPU, epoch=2)
    assert torch.equal(three, eight[[6, 1, 3]])
    alone = load_fashion_mnist(str(small), seed=3).images("train", idx[3:4], CPU, epoch=2)  # another actor
    assert torch.equal(alone, eight[3:4])
    assert torch.equal(src.images("train", idx, CPU, epoch=2, dtype=torch.float64), eight.double())
    assert not torch.equal(src.images("train", idx, CPU, epoch=3), eight)   # a new epoch, new crops
    assert not torch.equal(load_fashion_mnist(str(small), seed=4).images("train", idx, CPU, epoch=2), eight)


def test_training_images_are_really_cropped_and_flipped(small):
    """Each training image is one of the (2*PAD+1)^2 crops of its zero-padded original, mirrored or not;
    over 40 samples and 2 epochs both mirrored and unmirrored ones occur, and off-centre crops."""
    src = load_fashion_mnist(str(small), seed=0)
    raw = torch.from_numpy(fashion_mnist_arrays(str(small))["train"][0])          # (40, 1, 28, 28)
    padded = F.pad(raw, (PAD,) * 4)
    seen = set()
    for epoch in (0, 1):
        x = src.images("train", np.arange(40), CPU, epoch=epoch)
        for i in range(40):
            found = [(r, c, f) for r in range(2 * PAD + 1) for c in range(2 * PAD + 1) for f in (False, True)
                     if torch.equal(x[i], normalize((lambda t: t.flip(-1) if f else t)(
                         padded[i:i + 1, :, r:r + 28, c:c + 28]), src.mean, src.std)[0])]
            assert len(found) == 1, (epoch, i, found)   # random pixels: exactly one crop matches
            seen.add(found[0])
    assert {f for _, _, f in seen} == {False, True}
    assert any((r, c) != (PAD, PAD) for r, c, _ in seen)
    assert len({(r, c) for r, c, _ in seen}) > 20


def test_random_crop_flip_is_pad_crop_then_mirror():
    x = torch.arange(2 * 3 * 5 * 6, dtype=torch.int64).reshape(2, 3, 5, 6).to(torch.uint8)   # (N, C, H, W)
    offsets, flips = torch.tensor([[0, 4], [2, 2]]), torch.tensor([True, False])
    got = random_crop_flip(x, 2, offsets, flips)
    p = F.pad(x, (2, 2, 2, 2))
    assert got.shape == x.shape and got.dtype == torch.uint8
    assert torch.equal(got[0], p[0, :, 0:5, 4:10].flip(-1))
    assert torch.equal(got[1], x[1])    # offsets (pad, pad), no flip: the image itself


def test_normalize_and_resize_once_on_the_device(small):
    x = torch.tensor([[[[0, 255], [51, 102]]]], dtype=torch.uint8)                    # (1, 1, 2, 2)
    torch.testing.assert_close(normalize(x, [0.2], [0.5]), torch.tensor([[[[-0.4, 1.6], [0.0, 0.4]]]]))
    arrays = fashion_mnist_arrays(str(small))
    src = OnDeviceSource(arrays["train"], arrays["test"], 10, seed=0, pad=PAD, flip=True, image_size=32)
    assert src.sample_shape == (1, 32, 32)
    assert src.images("train", np.arange(4), CPU).shape == (4, 1, 32, 32)
    assert src.images("test", np.arange(4), CPU).shape == (4, 1, 32, 32)

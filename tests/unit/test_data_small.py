"""--data-on-device (rayconv/data/small.py), without Ray: a tiny image folder and a tiny shard folder
held on the device hold exactly the loader path's center images, normalised as the loader does; the
rule picks the loader for the resized crop and above the size limit; on + resized-crop is refused in
one line; a file that does not decode is named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from support.image_folder import write_folder
from rayconv.config import Config
from rayconv.data import small
from rayconv.data.decode import MEAN, STD
from rayconv.data.imagefolder import ImageFolderSource, center_transforms
from rayconv.data.registry import make_source
from rayconv.data.shard_writer import prepare
from rayconv.data.shards import ShardSource
from rayconv.errors import ConfigError, DataError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("folder"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    write_folder(root / "src", ".jpg")
    prepare(str(root / "src"), str(root / "shards"), size=40, shard_size=3, log=lambda *_: None, processes=1)
    return root / "shards"


def _cfg(data: str, root: Path, **kw) -> Config:
    return Config(data=data, data_dir=str(root), image_size=32, device="cpu", **kw).validate()


def _uint8(x: torch.Tensor) -> torch.Tensor:
    """The loader's normalised float images back as the uint8 pixels they were made from."""
    m, s = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return ((x * s + m) * 255).round().to(torch.uint8)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_held_image_folder_is_the_loaders_center_images(folder, workers):
    held = make_source(_cfg("imagefolder", folder, loader_workers=workers))
    assert isinstance(held, small.HeldSource) and not held.decoded          # built: nothing decoded yet
    loader = ImageFolderSource(str(folder), 32, seed=0, workers=0, augment="none")
    for split, n in (("train", 10), ("test", 4)):
        idx = np.arange(n)
        want = loader.images(split, idx, CPU)
        if split == "test":
            got = held.images(split, idx, CPU)
            assert torch.allclose(got, want, atol=1e-6)                         # the loader's normalisation
        assert torch.equal(held._on(CPU)[split], _uint8(want))                  # exactly its center images
        assert torch.equal(held.labels(split, idx), loader.labels(split, idx))
    assert held.sample_shape == (3, 32, 32) and held.num_classes == 2 and held.decoded
    assert "data held on the device" in held.describe() and "pad 4 + random crop + flip" in held.describe()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_held_shard_folder_is_the_loaders_center_images(shards, workers):
    held = make_source(_cfg("shards", shards, loader_workers=workers, augment="none"))
    loader = ShardSource(str(shards), 32, 0, 0, "cpu", "none")
    for split, n in (("train", 10), ("test", 4)):
        idx = np.arange(n)
        assert torch.equal(held._on(CPU)[split], loader.uint8_batch(split, idx, 0, CPU))
        assert torch.allclose(held.images(split, idx, CPU), loader.images(split, idx, CPU), atol=1e-6)
        assert torch.equal(held.labels(split, idx), loader.labels(split, idx))
    assert held.manifest == loader.manifest                                     # --shuffle block reads it


def test_held_data_is_augmented_per_sample_with_erasing_and_a_policy(folder):
    cfg = _cfg("imagefolder", folder, loader_workers=0, random_erase=1.0, auto_augment="ta_wide", seed=3)
    held, plain = make_source(cfg), make_source(_cfg("imagefolder", folder, loader_workers=0, augment="none"))
    idx = np.array([7, 2, 9, 0])
    x = held.images("train", idx, CPU, epoch=1)
    assert not torch.equal(x, plain.images("train", idx, CPU, epoch=1))
    # every image has an erased patch
    assert ((x == 0).all(1).sum((1, 2)) > 0).all()
    assert torch.equal(make_source(cfg).images("train", idx[[3, 1]], CPU, epoch=1), x[[3, 1]])
    assert "auto-augment ta_wide" in held.describe() and "random erasing p=1" in held.describe()


def test_the_rule_picks_the_loader_for_resized_crops_and_large_data(folder, shards, monkeypatch):
    assert isinstance(make_source(_cfg("shards", shards)), small.HeldSource)       # auto: 32 px pad-crop
    assert isinstance(make_source(_cfg("imagefolder", folder, augment="none")), small.HeldSource)
    assert isinstance(make_source(_cfg("imagefolder", folder, augment="resized-crop")), ImageFolderSource)
    assert isinstance(make_source(_cfg("shards", shards, data_on_device="off")), ShardSource)
    monkeypatch.setattr(small, "SMALL_DATA_BYTES", 14 * 3 * 32 * 32)           # exactly both splits: held
    assert isinstance(make_source(_cfg("imagefolder", folder)), small.HeldSource)
    monkeypatch.setattr(small, "SMALL_DATA_BYTES", 14 * 3 * 32 * 32 - 1)
    assert isinstance(make_source(_cfg("imagefolder", folder)), ImageFolderSource)
    assert isinstance(make_source(_cfg("imagefolder", folder, data_on_device="on")), small.HeldSource)


def test_on_with_resized_crops_is_refused_in_one_line_by_the_settings_check(folder, shards):
    """Refused by ``Config.validate``, before Ray starts or the data is read."""
    for data, root in (("imagefolder", folder), ("shards", shards)):
        with pytest.raises(ConfigError) as e:
            Config(data=data, data_dir=str(root), image_size=32, device="cpu", data_on_device="on",
                   augment="resized-crop").validate()
        assert (
            "\n" not in str(e.value)
            and "--data-on-device on" in str(e.value)
            and "resized-crop" in str(e.value)
        )
    with pytest.raises(SystemExit):
        from rayconv.flags import parse_args
        parse_args(["--data", "imagefolder", "--data-on-device", "yes"])


def test_the_held_folder_crops_with_pil_calls_checked_once_a_size(folder):
    from PIL import Image
    from torchvision.transforms import v2 as T

    centers = small._FolderCenters(folder, 32)
    centers.open("train")
    transform = T.Compose(center_transforms(32))
    rng = np.random.default_rng(1)
    for w, h in ((32, 32), (36, 36), (37, 100), (100, 37), (333, 500), (41, 40)):
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        assert np.array_equal(centers._center(image), np.asarray(transform(image)))
        assert centers.same[(w, h)]                                           # PIL's own calls were used
    centers.same[(41, 40)] = False                                            # (as if they differed)
    centers.transform = T.Compose([T.Resize(36, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop(32)])
    image = Image.fromarray(rng.integers(0, 256, (40, 41, 3), dtype=np.uint8))
    assert np.array_equal(centers._center(image), np.asarray(centers.transform(image)))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_that_does_not_decode_is_named(tmp_path, workers):
    root = write_folder(tmp_path / "f")
    bad = root / "train" / "b" / "3.png"
    bad.write_bytes(b"not a png")
    held = make_source(_cfg("imagefolder", root, loader_workers=workers))
    with pytest.raises(DataError) as e:
        held.images("train", np.arange(2), CPU)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_an_empty_class_folder_is_named(tmp_path):
    """A class folder without image files: the message names it and the suffixes, in one clean line."""
    from rayconv.data.imagefolder import CheckedImageFolder

    root = write_folder(tmp_path / "f")
    (root / "val" / "c").mkdir()
    (root / "train" / "c").mkdir()
    (root / "train" / "c" / "0.png").write_bytes((root / "train" / "a" / "0.png").read_bytes())
    with pytest.raises(DataError) as e:
        CheckedImageFolder(root / "val", None)
    msg = str(e.value)
    assert "class folder c has no image files (.jpg" in msg and ". :" not in msg and "\n" not in msg, msg


@pytest.mark.slow
def test_prepare_counts_what_it_encoded_and_names_what_it_skipped(tmp_path):
    """One corrupt file of 15: "14 images encoded", the corrupt one named (not "15 images encoded")."""
    root = write_folder(tmp_path / "src")
    (root / "train" / "a" / "bad.png").write_bytes(b"not a png")
    lines: list[str] = []
    prepare(str(root), str(tmp_path / "shards"), size=40, shard_size=4, log=lines.append, processes=1)
    assert "14 images encoded (1 not: train/a/bad.png did not decode) in " in lines[-1], lines


def test_auto_divides_the_memory_among_the_actors_holding_a_copy():
    """--data-on-device auto's bound is per node, not per actor: 1/HOLD_SHARE of a node's memory
    divided among its CPU actors (each holds its own copy), at most SMALL_DATA_BYTES; the help text
    states the bound from the constants."""
    from rayconv.choices import DATA_ON_DEVICE_HELP
    from rayconv.cluster.connect import node_memory_share

    gib, mb = 2**30, 2**20
    assert small.hold_limit(64 * gib, 1) == small.SMALL_DATA_BYTES == gib           # the cap
    assert small.hold_limit(16 * gib, 16) == 16 * gib // (small.HOLD_SHARE * 16)    # 16 actors share the node
    held, why = small.decide_auto(98 * mb, 16 * gib, 16, "the node's memory")
    assert held and "98.0 MB of decoded images per actor <= 256.0 MB" in why and "/ 16 actors" in why
    held, why = small.decide_auto(300 * mb, 16 * gib, 16, "the node's memory")
    assert not held and "300.0 MB of decoded images per actor > 256.0 MB" in why
    assert small.decide_auto(300 * mb, 16 * gib, 2, "the node's memory")[0]          # 2 actors: 1 GiB each
    # The node that leaves each copy least (its CPUs taken by as many of the actors as fit); a dead one not
    # counted.
    nodes = [{"Alive": True, "Resources": {"CPU": 16.0, "memory": 32.0 * gib}},
             {"Alive": True, "Resources": {"CPU": 2.0, "memory": 16.0 * gib}},
             {"Alive": False, "Resources": {"CPU": 64.0, "memory": 1.0 * gib}}]
    assert node_memory_share(nodes, 16, 1) == (32 * gib, 16)    # 2 GiB a copy there, 8 GiB on the small node
    assert node_memory_share(nodes, 16, 2) == (32 * gib, 8)     # 2 CPUs an actor: 8 of them there
    assert node_memory_share(nodes, 2, 1) == (16 * gib, 2)      # 2 actors: 16 GiB a copy there, 8 GiB here
    assert (
        f"{small.SMALL_DATA_BYTES / gib:g} GiB and 1/{small.HOLD_SHARE} of the memory" in DATA_ON_DEVICE_HELP
    )

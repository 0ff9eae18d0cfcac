"""``--data imagefolder`` end to end on real image files (PNG and JPEG written with PIL)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from torch import nn

from rayconv.data.imagefolder import ImageFolderSource
from rayconv.models import ConvNet
from rayconv.run import main

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

CLASSES = ("red", "green", "blue")
TRAIN_PER_CLASS, VAL_PER_CLASS = 6, 2
N_VAL = len(CLASSES) * VAL_PER_CLASS


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    """ImageNet layout: train/<class>/ (6 each) and val/<class>/ (2 each), 40x40 RGB, a class colour plus
    noise (so that crops and flips change the pixels), alternating PNG and JPEG."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for split, n in (("train", TRAIN_PER_CLASS), ("val", VAL_PER_CLASS)):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 80, (40, 40, 3))
                pixels[..., c] += 170
                img = Image.fromarray(pixels.astype(np.uint8))
                img.save(folder / (f"{name}{i}.png" if i % 2 == 0 else f"{name}{i}.JPEG"))
    return root


def test_imagefolder_end_to_end(ray_cluster, image_root, tmp_path):
    out = tmp_path / "run"
    # (no --data: the folder's train/ and val/ make it imagefolder, and config.json records that)
    rc = main(["--data-dir", str(image_root), "--image-size", "32", "--model", "convnet", "--dp", "2",
               "--steps", "3", "--global-batch-size", "8", "--loader-workers", "0", "--data-on-device", "off",
               "--device", "cpu", "--no-progress", "--out", str(out)])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.parquet", "model.pt",
                                                     "summary.json", "tensorboard"]

    config = json.loads((out / "config.json").read_text())
    assert config["data"] == "imagefolder" and config["data_dir"] == str(image_root) and config["dp"] == 2

    state = torch.load(out / "model.pt", weights_only=True)
    assert state["fc2.weight"].shape[0] == len(CLASSES)      # classes follow the folders
    assert state["conv1.weight"].shape[1] == 3                 # RGB
    model = ConvNet(3, len(CLASSES))
    model.load_state_dict(state, strict=True)

    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    assert [r["step"] for r in rows if r["kind"] == "train"] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows if r["kind"] == "train")
    assert any(r["kind"] == "eval" for r in rows)

    # Evaluation counted every val image once: a whole count out of 6, and the loss and accuracy of
    # the exported model on the 6 val images.
    summary = json.loads((out / "summary.json").read_text())
    acc = summary["test_accuracy"]
    assert abs(acc * N_VAL - round(acc * N_VAL)) < 1e-9
    src = ImageFolderSource(str(image_root), 32, seed=0, workers=0)
    assert (src.train_size, src.test_size, src.num_classes) == (18, N_VAL, 3)
    idx = np.arange(N_VAL)
    x, y = src.images("test", idx, torch.device("cpu")), src.labels("test", idx)
    with torch.no_grad():
        logits = model.eval()(x)
    assert nn.functional.cross_entropy(logits, y).item() == pytest.approx(summary["test_loss"], rel=1e-4)
    top2 = logits.topk(2, dim=1).values
    near_ties = int(((top2[:, 0] - top2[:, 1]) < 1e-4).sum())
    want_correct = int((logits.argmax(1) == y).sum())
    assert abs(round(acc * N_VAL) - want_correct) <= near_ties


def test_imagefolder_labels_follow_class_folders(image_root):
    src = ImageFolderSource(str(image_root), 32, seed=0, workers=0)
    assert src.sets["train"].inner.classes == sorted(CLASSES)
    idx = np.arange(src.train_size)
    paths = [Path(p) for p, _ in src.sets["train"].inner.samples]
    want = torch.tensor([sorted(CLASSES).index(p.parent.name) for p in paths])
    assert torch.equal(src.labels("train", idx), want)


def test_imagefolder_loading_is_deterministic(image_root):
    idx = np.array([5, 0, 11, 17, 3])
    cpu = torch.device("cpu")
    src = ImageFolderSource(str(image_root), 32, seed=0, workers=0)
    a = src.images("train", idx, cpu, epoch=1)
    assert a.shape == (5, 3, 32, 32) and a.dtype == torch.float32
    # Same (split, idx, epoch): the same tensor, also from a fresh source and whatever the global RNG.
    torch.manual_seed(123)
    assert torch.equal(src.images("train", idx, cpu, epoch=1), a)
    torch.manual_seed(456)
    assert torch.equal(ImageFolderSource(str(image_root), 32, seed=0, workers=0).images("train", idx, cpu,
                                                                                        epoch=1), a)
    # ...and not disturbing the caller's RNG stream.
    torch.manual_seed(7)
    want_next = torch.rand(3)
    torch.manual_seed(7)
    src.images("train", idx, cpu, epoch=1)
    assert torch.equal(torch.rand(3), want_next)
    # The augmentation is real: another epoch crops differently (so the equality above means something).
    assert not torch.equal(src.images("train", idx, cpu, epoch=2), a)
    # Decoding in a worker process gives the same images as decoding in the actor.
    assert torch.equal(ImageFolderSource(str(image_root), 32, seed=0, workers=1).images("train", idx, cpu,
                                                                                        epoch=1), a)
    # Evaluation images are not augmented.
    t = src.images("test", np.arange(N_VAL), cpu)
    assert torch.equal(src.images("test", np.arange(N_VAL), cpu, epoch=3), t)


def test_hidden_folders_and_files_are_not_data(tmp_path):
    """``.thumbnails`` beside the class folders is no class, and dot-files (macOS's ``._x.png``, not an
    image at all) and files in hidden subfolders are no images: real files through the real loader."""
    from rayconv.data.folders import check_image_folder
    from rayconv.errors import DataError

    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("cat", "dog", ".thumbnails"):
            (root / split / name).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)).save(
                root / split / name / "a.png"
            )
        (root / split / "cat" / "._a.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble, not a PNG")
        (root / split / "dog" / ".cache").mkdir()
        Image.fromarray(rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)).save(
            root / split / "dog" / ".cache" / "b.png"
        )
    src = ImageFolderSource(str(root), 32, seed=0, workers=0)
    assert src.num_classes == 2 and src.sets["train"].inner.classes == ["cat", "dog"]
    assert sorted(Path(p).relative_to(root).as_posix() for p, _ in src.sets["train"].inner.samples) == \
        ["train/cat/a.png", "train/dog/a.png"]
    assert src.train_size == src.test_size == 2
    x = src.images("train", np.arange(2), torch.device("cpu"))  # decodes every sample: no dot-file among them
    assert x.shape == (2, 3, 32, 32) and torch.equal(src.labels("train", np.arange(2)), torch.tensor([0, 1]))
    # rayconv.prepare reads the same folder alike: the same classes and images, nothing reported skipped,
    # and a hidden folder holding a non-image file draws no warning from --data imagefolder.
    from rayconv.data.folders import scan, warn_skipped

    (root / "train" / ".thumbnails" / "notes.txt").write_text("not data")
    classes, files, skipped = scan(root)
    assert classes == ["cat", "dog"] and skipped == {"train": [], "val": []}
    assert sorted(rel for rel, _ in files["train"]) == ["train/cat/a.png", "train/dog/a.png"]
    assert warn_skipped(root / "train") == 0
    # A folder whose only class folder is hidden has no classes.
    only_hidden = tmp_path / "only" / "train" / ".thumbnails"
    only_hidden.mkdir(parents=True)
    Image.fromarray(rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)).save(only_hidden / "a.png")
    with pytest.raises(DataError, match="has no class folders"):
        check_image_folder(tmp_path / "only" / "train")

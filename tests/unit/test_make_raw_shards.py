"""benchmarks/make_raw_shards.py: generated images written through the shard writer (``shard_table``) read
back by the real ``RawShardSource`` as generated (pixels and labels), with the manifest and sha256 as
prepare writes them (one pixel array gives the bytes of prepare's list of per-image bytes); classes told
apart by their patterns; an OUT holding other files refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from rayconv.data.raw_shards import RawShardSource
from rayconv.data.shard_table import write_rows
from rayconv.errors import DataError
from rayconv.files import sha256_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import make_raw_shards as gen  # noqa: E402

SIZE, CLASSES, SEED = 32, 5, 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "raw"
    gen.generate(str(out), images=250, size=SIZE, classes=CLASSES, val=30, shard_size=100, seed=SEED,
                 processes=1, log=lambda _: None)
    return out


def test_generated_shards_read_back_as_generated(folder):
    src = RawShardSource(str(folder), SIZE, seed=0)
    assert (src.train_size, src.test_size, src.num_classes) == (250, 30, CLASSES)
    for split, folder_split, shards in (("train", "train", (100, 100, 50)), ("test", "val", (30,))):
        want = [gen.shard_images(SEED, folder_split, k, n, SIZE, CLASSES) for k, n in enumerate(shards)]
        labels, pixels = np.concatenate([w[0] for w in want]), np.concatenate([w[1] for w in want])
        idx = np.random.default_rng(0).permutation(len(labels))   # (a gather across shards)
        assert np.array_equal(src.uint8(split, idx).numpy(), pixels[idx])
        assert np.array_equal(src.labels(split, idx).numpy(), labels[idx])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["format"], manifest["encoding"], manifest["image_shape"]) == ("rayconv-shards/3", "raw",
                                                                                   [32, 32, 3])
    train = manifest["splits"]["train"]
    assert [e["rows"] for e in train["shards"]] == [100, 100, 50] and train["images"] == 250
    assert sum(train["per_class"].values()) == 250 and all(train["per_class"].values())   # every class drawn
    for e in train["shards"] + manifest["splits"]["val"]["shards"]:
        assert sha256_file(folder / e["file"]) == e["sha256"]
    assert not list(folder.glob("*.tmp"))


def test_classes_are_told_apart_by_their_patterns():
    """The nearest class pattern (sum of squared differences) of each generated image is its label,
    and images of one class are not all alike (the noise)."""
    patterns = gen.class_patterns(SEED, SIZE, CLASSES).reshape(CLASSES, -1).astype(np.int32)
    labels, pixels = gen.shard_images(SEED, "train", 0, 200, SIZE, CLASSES)
    x = pixels.reshape(len(labels), -1).astype(np.int32)
    nearest = ((x[:, None, :] - patterns[None]) ** 2).sum(-1).argmin(1)
    assert np.array_equal(nearest, labels)
    assert len(np.unique(x[labels == labels[0]], axis=0)) == (labels == labels[0]).sum()


def test_the_same_command_keeps_the_folder_and_another_refuses_it(folder, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    gen.generate(str(folder), images=250, size=SIZE, classes=CLASSES, val=30, shard_size=100, seed=SEED,
                 processes=1, log=lambda _: None)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    with pytest.raises(DataError, match="not a new or empty folder"):
        gen.generate(str(folder), images=251, size=SIZE, classes=CLASSES, val=30, shard_size=100, seed=SEED,
                     processes=1, log=lambda _: None)
    assert gen.main([str(tmp_path / "x"), "--images", "0"]) == 2


def test_pixels_as_one_array_write_the_bytes_of_pixels_as_prepares_list(tmp_path):
    """``write_rows`` takes a raw shard's pixels as prepare gives them (one bytes object an image) or
    as one uint8 array: the same file either way, counts in the order labels first appear."""
    labels, pixels = gen.shard_images(SEED, "train", 0, 20, SIZE, CLASSES)
    meta = {"settings": {"size": SIZE, "encoding": "raw"}, "inputs_sha256": "x"}
    base = {"index": list(range(20)), "label": labels.tolist(), "height": [SIZE] * 20, "width": [SIZE] * 20,
            "path": [None] * 20}
    as_list = write_rows(tmp_path / "a.arrow", {**base, "pixels": [p.tobytes() for p in pixels]}, meta, [],
                         SIZE)
    as_array = write_rows(tmp_path / "b.arrow", {**base, "pixels": pixels}, meta, [], SIZE)
    assert as_list["sha256"] == as_array["sha256"]
    assert list(as_array["counts"]) == list(dict.fromkeys(str(k) for k in labels.tolist()))
    with pytest.raises(ValueError, match="pixels of shape"):
        write_rows(tmp_path / "c.arrow", {**base, "pixels": pixels[:, :16]}, meta, [], SIZE)
    assert not (tmp_path / "c.arrow").exists()

"""``python -m rayconv.prepare --shard-order shuffled|sorted --seed S`` (no Ray: the shard calls run in one
local process): the train shards of the default order mix the classes, the same command writes the same
bytes, ``sorted`` keeps the listing's layout, the order and seed are settings (a resume with the same ones
skips complete shards; other ones are refused while a manifest is there, rewritten when none is)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from rayconv import prepare as prep
from rayconv.data.shard_writer import on_processes

CLASSES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """4 classes x 12 train and 2 val JPEGs, 20 x 24 pixels (prepared at --size 32: kept at their size)."""
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("val", 2)):
        for name in CLASSES:
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                px = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(px).save(root / split / name / f"{i:02d}.jpg")
    return root


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(prep, "_on_ray", lambda args, address: on_processes(args, 1))


def run(src: Path, out: Path, *flags: str) -> None:
    assert prep.main([str(src), "--out", str(out), "--size", "32", "--shard-size", "8", *flags]) == 0


def rows(out: Path, split: str = "train") -> list[list[dict]]:
    return [pa.ipc.open_file(str(p)).read_all().drop_columns(["jpeg"]).to_pylist()
            for p in sorted(out.glob(f"{split}-*.arrow"))]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_shuffled_shards_mix_classes_and_the_same_command_writes_the_same_bytes(src, tmp_path):
    run(src, tmp_path / "x")
    shards = rows(tmp_path / "x")
    assert len(shards) == 6 and all(len({r["label"] for r in s}) >= 2 for s in shards)
    flat = [r for s in shards for r in s]
    # index: the file's position in the sorted listing (a permutation of it here); path: that file.
    listing = sorted(f"train/{c}/{i:02d}.jpg" for c in CLASSES for i in range(12))
    assert sorted(r["index"] for r in flat) == list(range(48)) and [r["index"]
                                                                    for r in flat] != list(range(48))
    assert all(listing[r["index"]] == r["path"] and CLASSES[r["label"]] == r["path"].split("/")[1]
               for r in flat)
    assert [r["path"] for r in rows(tmp_path / "x", "val")[0]] == sorted(f"val/{c}/{i:02d}.jpg"
                                                                         for c in CLASSES for i in range(2))
    m = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert m["settings"] == {"size": 32, "quality": 90, "shard_size": 8, "shard_order": "shuffled", "seed": 0,
                             "encoding": "jpeg"}
    run(src, tmp_path / "y")
    assert files(tmp_path / "y") == files(tmp_path / "x")
    run(src, tmp_path / "z", "--seed", "1")
    assert [r["path"] for s in rows(tmp_path / "z") for r in s] != [r["path"] for r in flat]


def test_sorted_keeps_the_listing_layout(src, tmp_path):
    run(src, tmp_path / "s", "--shard-order", "sorted", "--seed", "5")
    flat = [r for s in rows(tmp_path / "s") for r in s]
    assert [r["index"] for r in flat] == list(range(48))
    assert [r["path"] for r in flat] == sorted(f"train/{c}/{i:02d}.jpg" for c in CLASSES for i in range(12))
    assert [len({r["label"] for r in s}) for s in rows(tmp_path / "s")] == [1, 2, 1, 1, 2, 1]
    settings = json.loads((tmp_path / "s" / "manifest.json").read_text())["settings"]
    assert settings["shard_order"] == "sorted" and settings["seed"] is None   # no permutation, no seed


def test_resume_skips_complete_shards_and_other_orders_rewrite(src, tmp_path, capsys):
    out = tmp_path / "r"
    run(src, out)
    (out / "train-00002.arrow").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.arrow")}
    capsys.readouterr()
    run(src, out)
    assert "(6 already complete)" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.arrow") if p.name in kept} == kept
    # Another order into the folder: refused while its manifest is there (as for any other setting) ...
    assert prep.main([str(src), "--out", str(out), "--size", "32", "--shard-size", "8", "--seed", "1"]) == 2
    assert "use the same settings" in capsys.readouterr().err
    # ... and with none (an interrupted run), every shard is written again.
    (out / "manifest.json").unlink()
    run(src, out, "--shard-order", "sorted")
    assert "(0 already complete)" in capsys.readouterr().out
    assert [r["index"] for s in rows(out) for r in s] == list(range(48))


def test_a_manifest_without_the_order_keys_is_a_sorted_one(src, tmp_path, capsys):
    out = tmp_path / "old"
    run(src, out, "--shard-order", "sorted")
    m = json.loads((out / "manifest.json").read_text())
    m["settings"] = {k: m["settings"][k] for k in ("size", "quality", "shard_size")}
    (out / "manifest.json").write_text(json.dumps(m))
    capsys.readouterr()
    run(src, out, "--shard-order", "sorted")
    assert "(7 already complete)" in capsys.readouterr().out
    assert prep.main([str(src), "--out", str(out), "--size", "32", "--shard-size", "8"]) == 2

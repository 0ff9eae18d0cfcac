"""``python -m rayconv.prepare`` on a real local Ray cluster and ``--data shards`` through the real loader:
real image files (JPEG, PNG, WebP, CMYK and grayscale JPEGs, and bad ones) written with PIL in tmp."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from support.helpers import assert_same_state, reference_sgd
from rayconv import prepare as prep
from rayconv.config import Config
from rayconv.data.imagefolder import ImageFolderSource
from rayconv.data.folders import scan
from rayconv.data.registry import make_source
from rayconv.errors import DataError
from rayconv.data.decode import crop_params
from rayconv.driver.job import train_run
from rayconv.run import main
from rayconv.data.shard_writer import shard_listing
from rayconv.data.shards import ShardSource
from rayconv.files import sha256_file

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

CLASSES = ("cat", "dog")
SIZE = 40   # --size: the shorter side of the re-encoded images


def _pixels(rng, h: int, w: int, c: int) -> np.ndarray:
    px = rng.integers(0, 90, (h, w, 3)).astype(np.uint8)
    px[..., c] += 160
    return px


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """train/<class>/ with 6 good JPEGs of various sizes each (one 80 x 120, to be downscaled) plus, in
    train/cat/: a PNG, a WebP, a grayscale JPEG and a CMYK JPEG (converted), and a truncated JPEG, random
    bytes named .jpg, an empty file, a text file, a dangling link and a directory named like an image
    (skipped); val/<class>/ with 2 JPEGs each."""
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for c, name in enumerate(CLASSES):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(n):
                h, w = (80, 120) if i == 0 else (24 + 5 * i, 36)
                Image.fromarray(_pixels(rng, h, w, c)).save(d / f"{name}{i}.JPEG", quality=90)
    cat = root / "train" / "cat"
    img = Image.fromarray(_pixels(rng, 30, 44, 0))
    img.save(cat / "x-png.png")
    img.save(cat / "x-webp.webp")
    img.convert("L").save(cat / "x-gray.jpg")
    img.convert("CMYK").save(cat / "x-cmyk.jpg")
    good = (cat / "cat1.JPEG").read_bytes()
    (cat / "bad-truncated.jpg").write_bytes(good[: len(good) // 2])
    (cat / "bad-random.jpg").write_bytes(rng.integers(0, 256, 500).astype(np.uint8).tobytes())
    (cat / "bad-zero.jpg").write_bytes(b"")
    (cat / "notes.txt").write_text("not an image")
    os.symlink(cat / "missing.jpg", cat / "bad-link.jpg")
    (cat / "bad-dir.jpg").mkdir()
    return root


@pytest.fixture(scope="module")
def shards(ray_cluster, folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "s"
    assert prep.main([str(folder), "--out", str(out), "--size", str(SIZE), "--shard-size", "4"]) == 0
    return out


@pytest.mark.slow
def test_prepare_writes_a_checked_manifest(shards, folder):
    m = json.loads((shards / "manifest.json").read_text())
    assert m["classes"] == list(CLASSES) and m["settings"] == {"size": SIZE, "quality": 90, "shard_size": 4,
                                                               "shard_order": "shuffled", "seed": 0,
                                                               "encoding": "jpeg"}
    train = m["splits"]["train"]
    assert train["per_class"] == {"cat": 10, "dog": 6} and train["images"] == 16
    assert m["splits"]["val"]["per_class"] == {"cat": 2, "dog": 2}
    reasons = {s["path"]: s["reason"] for s in train["skipped"]}
    assert sorted(reasons) == sorted(f"train/cat/{n}" for n in ("bad-truncated.jpg", "bad-random.jpg",
                                                                "bad-zero.jpg", "notes.txt", "bad-link.jpg",
                                                                "bad-dir.jpg"))
    assert reasons["train/cat/notes.txt"].startswith("not an image")
    assert reasons["train/cat/bad-dir.jpg"].startswith("a directory")
    assert "FileNotFoundError" in reasons["train/cat/bad-link.jpg"]
    assert reasons["train/cat/bad-truncated.jpg"].startswith("cannot read or decode")
    # 20 train files with an image suffix in prepare's seeded order, 4 per shard: rows are the files kept.
    order = shard_listing(scan(folder)[1]["train"], "shuffled", 0)
    # listed, do not decode
    bad = {f"train/cat/bad-{n}.jpg" for n in ("truncated", "random", "zero", "link")}
    assert len(order) == 20 and bad <= {r for _, r, _ in order}
    assert [e["rows"] for e in train["shards"]] == [sum(r not in bad for _, r, _ in order[k:k + 4])
                                                    for k in range(0, 20, 4)]
    for e in train["shards"] + m["splits"]["val"]["shards"]:
        p = shards / e["file"]
        assert p.stat().st_size == e["bytes"] and sha256_file(p) == e["sha256"]
    assert not list(shards.glob("*.tmp"))
    assert not list(shards.glob("*.parquet"))
    table = pa.concat_tables([pa.ipc.open_file(p).read_all()
                              for p in sorted(shards.glob("train-*.arrow"))]).to_pylist()
    assert [(r["index"], r["path"]) for r in table] == [(i, r) for i, r, _ in order if r not in bad]
    by_path = {r["path"]: r for r in table}
    # CMYK, grayscale, PNG and WebP became RGB JPEGs; the 80 x 120 one was downscaled to shorter side 40.
    for name in ("x-png.png", "x-webp.webp", "x-gray.jpg", "x-cmyk.jpg"):
        r = by_path[f"train/cat/{name}"]
        from torchvision.io import decode_jpeg
        img = decode_jpeg(torch.frombuffer(bytearray(r["jpeg"]), dtype=torch.uint8))
        assert img.shape == (3, r["height"], r["width"]) == (3, 30, 44), name
    big = by_path["train/cat/cat0.JPEG"]
    assert (big["height"], big["width"]) == (SIZE, 60)
    gray = decode_jpeg(torch.frombuffer(bytearray(by_path["train/cat/x-gray.jpg"]["jpeg"]),
                                        dtype=torch.uint8))
    assert torch.equal(gray[0], gray[1])   # converted: three equal channels


def test_prepare_resumes_and_rewrites_only_bad_shards(shards, tmp_path, capsys):
    out = tmp_path / "s"
    shutil.copytree(shards, out)
    (out / "train-00001.arrow").unlink()
    bad = out / "train-00003.arrow"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF          # a flipped bit inside the JPEG bytes: same size, other sha256
    bad.write_bytes(bytes(data))
    (out / "train-00004.arrow.tmp").write_bytes(b"half")   # left by an interrupted run
    untouched = {p.name: p.stat().st_mtime_ns for p in out.glob("*.arrow") if p.name != bad.name}
    capsys.readouterr()
    src = json.loads((shards / "manifest.json").read_text())["source"]
    assert prep.main([src, "--out", str(out), "--size", str(SIZE), "--shard-size", "4"]) == 0
    assert "(4 already complete)" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.arrow") if p.name in untouched} == untouched
    assert (out / "manifest.json").read_text() == (shards / "manifest.json").read_text()
    assert not list(out.glob("*.tmp"))


def test_prepare_bad_input_is_one_line_and_writes_nothing(ray_cluster, folder, shards, tmp_path, capsys):
    def failing(argv) -> str:
        capsys.readouterr()
        assert prep.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    src = tmp_path / "src"
    shutil.copytree(folder, src, symlinks=True)
    (src / "val" / "dog" / "dog0.JPEG").unlink()
    (src / "val" / "dog" / "dog1.JPEG").unlink()
    err = failing([str(src), "--out", str(tmp_path / "o1")])
    assert f"class folder {src / 'val' / 'dog'} has no image files" in err
    assert not (tmp_path / "o1").exists()
    shutil.rmtree(src / "val" / "dog")
    assert "same class folders" in failing([str(src), "--out", str(tmp_path / "o2")])
    assert "does not exist" in failing([str(tmp_path / "nowhere"), "--out", str(tmp_path / "o3")])
    # Other settings into a prepared folder: refused, the folder untouched.
    before = sorted((p.name, p.stat().st_mtime_ns) for p in shards.iterdir())
    assert "use the same settings" in failing([str(folder), "--out", str(shards), "--size", "64",
                                               "--shard-size", "4"])
    assert sorted((p.name, p.stat().st_mtime_ns) for p in shards.iterdir()) == before
    # A folder holding other files is not written into.
    (tmp_path / "o5").mkdir()
    (tmp_path / "o5" / "metrics.parquet").write_bytes(b"mine")
    assert "holds files prepare did not write (metrics.parquet)" in failing([str(folder), "--out",
                                                                             str(tmp_path / "o5")])
    assert (tmp_path / "o5" / "metrics.parquet").read_bytes() == b"mine"
    assert "--quality" in failing([str(folder), "--out", str(tmp_path / "o4"), "--quality", "0"])


def test_training_refuses_a_folder_that_does_not_match_its_manifest(shards, tmp_path):
    cases = {
        "missing": lambda d: (d / "val-00000.arrow").unlink(),
        "not listed": lambda d: shutil.copy(d / "val-00000.arrow", d / "extra.arrow"),
        "bytes": lambda d: open(d / "train-00002.arrow", "ab").write(b"x"),
        "not a readable Arrow shard": _damage_footer,
    }
    for want, damage in cases.items():
        d = tmp_path / want.replace(" ", "-")
        shutil.copytree(shards, d)
        damage(d)
        with pytest.raises(DataError, match=want):
            ShardSource(str(d), 32, seed=0, workers=0)
    # (The whole-file sha256 is checked by prepare's resume, above, and by --stage-dir; not by every reader.)


def _damage_footer(d: Path) -> None:
    """The last bytes of a shard (its Arrow footer) overwritten: same size, no longer readable."""
    p = d / "train-00004.arrow"
    data = bytearray(p.read_bytes())
    data[-10:] = b"\0" * 10
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_that_disappears_or_changes_while_open_is_named(shards, tmp_path, workers):
    d = tmp_path / "d"
    shutil.copytree(shards, d)
    cpu = torch.device("cpu")
    src = ShardSource(str(d), 32, seed=0, workers=workers, decode="cpu")
    assert src.images("train", np.arange(6), cpu).shape == (6, 3, 32, 32)
    p = d / "train-00002.arrow"
    starts = np.cumsum([0] + [e["rows"] for e in src.entries["train"]])
    mine = np.arange(starts[2], starts[3])   # the samples of train-00002
    others = np.setdiff1d(np.arange(starts[-1]), mine)[:3]
    assert len(mine) and len(others) == 3
    p.rename(d / "away")
    src.prefetch("train", 0, [others, mine])
    assert src.images("train", others, cpu).shape[0] == 3   # other shards read on
    with pytest.raises(DataError, match=f"{p} disappeared during the run"):
        src.images("train", mine, cpu)
    shutil.copy(d / "away", p)   # the same bytes back, but another file (inode, mtime)
    with pytest.raises(DataError, match=f"{p} changed"):
        src.images("train", mine, cpu)
    # Opened again, the folder reads as before.
    fresh = ShardSource(str(d), 32, seed=0, workers=0)
    torch.testing.assert_close(
        fresh.images("train", np.arange(8), cpu),
        ShardSource(str(shards), 32, seed=0, workers=0).images("train", np.arange(8), cpu))


@pytest.mark.slow
def test_the_val_split_reads_train_shards_center_cropped(shards):
    """--val-split's "val" split: the train shards' samples as --augment none reads them, whatever the
    training augmentation (and auto-augment, random erasing: training's only)."""
    idx, cpu = np.array([9, 2, 14]), torch.device("cpu")
    src = ShardSource(str(shards), 32, seed=0, workers=0, augment="resized-crop", random_erase=0.5,
                      auto_augment="ta_wide")
    src.add_val_split()
    plain = ShardSource(str(shards), 32, seed=0, workers=0, augment="none").images("train", idx, cpu, epoch=1)
    assert torch.equal(src.images("val", idx, cpu), plain)
    assert not torch.equal(src.images("train", idx, cpu, epoch=1), plain)
    assert torch.equal(src.labels("val", idx), src.labels("train", idx))


def test_crop_and_flip_depend_only_on_seed_epoch_index(shards):
    idx = np.array([15, 0, 7, 3, 11])
    cpu = torch.device("cpu")
    a = ShardSource(str(shards), 32, seed=0, workers=0).images("train", idx, cpu, epoch=1)
    assert a.shape == (5, 3, 32, 32) and a.dtype == torch.float32
    # Two worker processes, batches announced ahead in another grouping: the same samples.
    src = ShardSource(str(shards), 32, seed=0, workers=2, decode="cpu")
    src.prefetch("train", 1, [idx[:2], idx[2:]])
    assert torch.equal(torch.cat([src.images("train", idx[:2], cpu, 1),
                                  src.images("train", idx[2:], cpu, 1)]), a)
    assert torch.equal(src.images("train", idx[::-1].copy(), cpu, 1), a.flip(0))
    assert not torch.equal(src.images("train", idx, cpu, epoch=2), a)   # the augmentation is real
    t = src.images("test", np.arange(4), cpu)
    assert torch.equal(src.images("test", np.arange(4), cpu, epoch=3), t)   # evaluation: not augmented
    # The crop box follows torchvision's RandomResizedCrop: inside the image, aspect 3/4..4/3, area 8-100%.
    for seed in range(200):
        top, left, h, w, _ = crop_params(40, 60, seed)
        assert 0 <= top <= 40 - h and 0 <= left <= 60 - w
        assert 0.08 * 2400 * 0.9 <= h * w <= 2400 and 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    with pytest.raises(DataError, match="--decode gpu"):
        ShardSource(str(shards), 32, seed=0, workers=0, decode="gpu").images("train", idx, cpu)


def shard_config(data_dir: Path, out: Path, **kw) -> Config:
    # 16 train images, global batch 6: steps of 6, 6 and 4 per epoch; 5 steps cross an epoch boundary.
    base = dict(model="convnet", data="shards", data_dir=str(data_dir), image_size=32, dp=2,
                global_batch_size=6, steps=5, lr=0.05, momentum=0.9, weight_decay=5e-4, precision="fp64",
                device="cpu", progress=False, eval_every=5, loader_workers=1, decode="cpu",
                data_on_device="off", out=str(out))
    base.update(kw)
    return Config(**base).validate()


def test_shard_flags_are_checked(ray_cluster, folder, tmp_path, capsys):
    # (before the dp=2 run: the four actors these refused runs started stay kept, and it takes two of them)
    def failing(argv) -> str:
        capsys.readouterr()
        assert main(["--steps", "1", "--no-progress", "--out", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rayconv: error:"), err
        return err[0]

    assert "--data-dir SHARDS" in failing(["--data", "shards"])
    assert "--decode cpu" in failing(["--data", "shards", "--data-dir", str(folder), "--device", "cpu",
                                      "--decode", "gpu"])
    assert "no manifest.json" in failing(["--data", "shards", "--data-dir", str(folder), "--device", "cpu"])
    missing = failing(["--data", "shards", "--data-dir", str(tmp_path / "shardz"), "--device", "cpu"])
    assert "shardz does not exist: check --data-dir" in missing and "prepare it" not in missing
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_dp2_on_shards_equals_single_device_sgd_and_resumes_exactly(ray_cluster, shards, tmp_path):
    cfg = shard_config(shards, tmp_path / "a", checkpoint_every=2, keep_checkpoints=0)
    train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, 5), atol=1e-10)
    # Resumed mid-epoch (step 2 of 3) on another loader worker count: bit-identical.
    assert main(["--resume", str(tmp_path / "a" / "checkpoints" / "step-2"), "--out", str(tmp_path / "b"),
                 "--loader-workers", "0"]) == 0
    torch.testing.assert_close(torch.load(tmp_path / "b" / "model.pt", weights_only=True), got, rtol=0,
                               atol=0)


def test_a_prepared_folder_given_as_imagefolder_is_read_as_shards(shards):
    cfg = Config(data="imagefolder", data_dir=str(shards), image_size=32, device="cpu", loader_workers=0,
                 data_on_device="off").validate()
    src = make_source(cfg)
    assert isinstance(src, ShardSource) and (src.train_size, src.test_size, src.num_classes) == (16, 4, 2)


def test_imagefolder_path_on_the_same_bad_inputs(folder, capsys):
    """--data imagefolder: entries ImageFolder leaves out are counted in one warning line; CMYK, grayscale,
    PNG and WebP decode to RGB; a file that does not decode or cannot be read stops with its path."""
    capsys.readouterr()
    src = ImageFolderSource(str(folder), 32, seed=0, workers=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 2 entries" in err[0] and "train/cat/bad-dir.jpg" in err[0], err
    assert src.skipped == 2
    paths = [Path(p).name for p, _ in src.sets["train"].inner.samples]
    ok = [i for i, n in enumerate(paths) if not n.startswith("bad-")]
    x = src.images("train", np.array(ok), torch.device("cpu"), epoch=0)
    assert x.shape == (len(ok), 3, 32, 32) and len(ok) == 16
    for name in ("bad-truncated.jpg", "bad-random.jpg", "bad-zero.jpg", "bad-link.jpg"):
        with pytest.raises(DataError, match=f"cannot decode image .*{name}"):
            src.images("train", np.array([paths.index(name)]), torch.device("cpu"))

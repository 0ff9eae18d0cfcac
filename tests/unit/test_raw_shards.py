"""Raw-pixel shards (``python -m rayconv.prepare --encoding raw``), without Ray (the shard calls run in
one local process): the stored pixels are the source's where lossless (PNG), and JPEG shards' decode
of the same resize within JPEG's error; a flipped byte is caught by the sha256 checks; block and exact
orders give the same samples as JPEG shards of the same folder; streamed batches equal held ones;
``--convert --encoding`` re-encodes; a JPEG folder whose manifest has no ``encoding`` reads as before;
one gather reads rows of pieces at any addresses; the reader process's gathers keep the order of the
requests, and the process ends with its source (closed, collected, or its process killed) and names its
own end as a one-line error; a shard that changed is named before its bytes are read."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from rayconv import prepare as prep
from rayconv.cluster.local_copy import is_copied
from rayconv.config import Config
from rayconv.data.order import make_order
from rayconv.data.raw_gather import RowGather
from rayconv.data.raw_shards import RING, RawShardSource
from rayconv.data.registry import make_source
from rayconv.data.shard_convert import convert_encoding
from rayconv.data.shard_writer import on_processes, resolve_encoding
from rayconv.data.shards import ShardSource
from rayconv.data.small import HeldSource
from rayconv.data.source import Sharding
from rayconv.errors import DataError
from tests.support.image_folder import write_folder

CPU = torch.device("cpu")
SIZE = 32


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """3 classes x 6 train and 2 val PNGs: 32 x 32 (stored as they are), and one 40 x 52 a class (resized
    and cropped)."""
    def smooth(rng, c, i, shape):   # (JPEG's error on noise would be large): a gradient, a little noise
        yy, xx = np.mgrid[:shape[0], :shape[1]]
        px = yy[..., None] * 2 + xx[..., None] * (1 + c % 2) + 30 * np.arange(3) + 4 * i
        return (px + rng.integers(0, 4, shape)).astype(np.uint8)

    return write_folder(tmp_path_factory.mktemp("src"), train=6, val=2, classes="abc", grey=False,
                        shape=lambda i: (40, 52) if i == 0 else (SIZE, SIZE), pixels=smooth)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(prep, "_on_ray", lambda args, address: on_processes(args, 1))


def _prepare(src: Path, out: Path, *flags: str) -> Path:
    assert prep.main([str(src), "--out", str(out), "--size", str(SIZE), "--shard-size", "5", *flags]) == 0
    return out


@pytest.fixture(scope="module")
def folders(src, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("prepared")
    mp = pytest.MonkeyPatch()
    mp.setattr(prep, "_on_ray", lambda args, address: on_processes(args, 1))
    try:
        return {"raw": _prepare(src, base / "raw", "--encoding", "auto"),
                "jpeg": _prepare(src, base / "jpeg")}
    finally:
        mp.undo()


def _rows(folder: Path, split: str = "train") -> list[dict]:
    return [r for p in sorted(folder.glob(f"{split}-*.arrow"))
            for r in pa.ipc.open_file(str(p)).read_all().to_pylist()]


def test_auto_is_raw_up_to_64_px_and_the_manifest_says_so(folders, capsys):
    assert [resolve_encoding("auto", s) for s in (32, 64, 65)] == ["raw", "raw", "jpeg"]
    assert [
        prep.default_shard_size(e, s) for e, s in (("raw", 32), ("raw", 64), ("raw", 256), ("jpeg", 32))
    ] == [
        21845,
        5461,
        1000,
        1000,
    ]  # 64 MiB raw shards, at least 1000 images
    # re-encoding needs --out
    assert prep.main(["--convert", str(folders["jpeg"]), "--encoding", "raw"]) == 2
    assert "--out NEW" in capsys.readouterr().err
    m = json.loads((folders["raw"] / "manifest.json").read_text())
    assert (m["format"], m["encoding"], m["image_shape"]) == ("rayconv-shards/3", "raw", [SIZE, SIZE, 3])
    assert json.loads((folders["jpeg"] / "manifest.json").read_text())["format"] == "rayconv-shards/2"


def test_without_image_size_raw_shards_train_at_their_stored_side(folders):
    # (JPEG shards keep ImageNet's 224: their stored images are larger than the crop)
    cfg = Config(data="shards", data_dir=str(folders["raw"]), device="cpu", loader_workers=0).validate()
    assert cfg.data_image_size == SIZE and cfg.augmentation == "pad-crop"
    assert make_source(cfg).sample_shape == (3, SIZE, SIZE)
    jpeg = Config(data="shards", data_dir=str(folders["jpeg"]), device="cpu", loader_workers=0).validate()
    assert jpeg.data_image_size == 224 and jpeg.augmentation == "resized-crop"


def test_raw_pixels_are_the_source_and_jpeg_shards_decode_the_same_resize(src, folders):
    from torchvision.io import decode_jpeg

    jpeg = {r["path"]: r for r in _rows(folders["jpeg"]) + _rows(folders["jpeg"], "val")}
    rows = _rows(folders["raw"]) + _rows(folders["raw"], "val")
    assert len(rows) == 24 and {r["path"] for r in rows} == set(jpeg)
    for r in rows:
        raw = np.frombuffer(r["pixels"], np.uint8).reshape(SIZE, SIZE, 3)
        source = np.asarray(Image.open(src / r["path"]).convert("RGB"))
        if source.shape[:2] == (SIZE, SIZE):
            # lossless: the PNG's pixels
            assert np.array_equal(raw, source), r["path"]
        # JPEG shards: the same resize (shorter side to SIZE), JPEG-coded; the same center crop of it
        dec = decode_jpeg(torch.frombuffer(bytearray(jpeg[r["path"]]["jpeg"]), dtype=torch.uint8))
        dec = dec.permute(1, 2, 0).numpy()
        top, left = (dec.shape[0] - SIZE) // 2, (dec.shape[1] - SIZE) // 2
        diff = np.abs(dec[top:top + SIZE, left:left + SIZE].astype(int) - raw.astype(int))
        assert diff.mean() < 3 and diff.max() < 48, (r["path"], diff.mean(), diff.max())


def test_a_flipped_byte_is_caught_by_the_sha256_checks(src, folders, tmp_path, capsys):
    out = tmp_path / "raw"
    shutil.copytree(folders["raw"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]
    path = out / entry["file"]
    good = path.read_bytes()
    assert is_copied(path, entry)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01                              # a pixel byte, same size: only sha256 tells
    path.write_bytes(bytes(bad))
    assert not is_copied(path, entry)                       # --stage-dir copies it again
    _prepare(src, out, "--encoding", "raw")                 # a re-run rewrites it, keeps the others
    now = path.read_bytes()
    assert now == good and "(5 already complete)" in capsys.readouterr().out


def test_block_and_exact_orders_give_the_same_samples_as_jpeg_shards(folders):
    sources = {e: make_source(Config(data="shards", data_dir=str(f), image_size=SIZE, device="cpu",
                                     data_on_device="off", shuffle="block", shuffle_window=2).validate())
               for e, f in folders.items()}
    assert isinstance(sources["raw"], RawShardSource) and isinstance(sources["jpeg"], ShardSource)
    paths = {e: [r["path"] for r in _rows(f)] for e, f in folders.items()}
    assert paths["raw"] == paths["jpeg"]
    for shuffle in ("block", "exact"):
        cfg = Config(data="shards", data_dir="x", shuffle=shuffle, shuffle_window=2, seed=3).validate()
        orders = {e: Sharding(s.train_size, 8, 3, make_order(cfg, s)).epoch_permutation(1)
                  for e, s in sources.items()}
        assert np.array_equal(orders["raw"], orders["jpeg"])
        assert torch.equal(sources["raw"].labels("train", orders["raw"]),
                           sources["jpeg"].labels("train", orders["jpeg"]))


def test_streamed_batches_equal_held_ones_and_the_gather_is_read_ahead(folders):
    def cfg(on: str) -> Config:
        return Config(data="shards", data_dir=str(folders["raw"]), image_size=SIZE, device="cpu",
                      augment="pad-crop", random_erase=0.5, loader_workers=0, data_on_device=on).validate()

    streamed, held = make_source(cfg("off")), make_source(cfg("on"))
    assert isinstance(streamed, RawShardSource) and isinstance(held, HeldSource)
    assert held.hold(CPU)["images"] == 24
    batches = [np.array([3, 0, 17, 9]), np.array([11, 2, 5])]
    streamed.prefetch("train", 1, batches)
    # requested ahead of the reader process
    assert all(n is not None for _, n in streamed._pending["train"])
    for b in batches:
        torch.testing.assert_close(streamed.images("train", b, CPU, epoch=1),
                                   held.images("train", b, CPU, epoch=1), rtol=0, atol=0)
    test = np.arange(6)
    torch.testing.assert_close(streamed.images("test", test, CPU), held.images("test", test, CPU), rtol=0,
                               atol=0)


def test_the_validation_split_reads_train_images_unaugmented(folders):
    cfg = Config(data="shards", data_dir=str(folders["raw"]), image_size=SIZE, device="cpu",
                 augment="pad-crop", random_erase=0.5, loader_workers=0, data_on_device="off",
                 val_split=0.25).validate()
    source = make_source(cfg)
    plain = make_source(dataclasses.replace(cfg, augment="none", random_erase=0.0, val_split=0.0))
    idx = np.array([4, 1, 7])
    torch.testing.assert_close(source.images("val", idx, CPU, epoch=1), plain.images("train", idx, CPU),
                               rtol=0, atol=0)
    assert torch.equal(source.labels("val", idx), plain.labels("train", idx))


def test_a_long_announcement_reuses_the_ring_of_gather_buffers(folders):
    """More batches than the ring has buffers, of several sizes: each equals the same batch gathered
    alone, and the reader process writes them into the RING buffers of one ring, made once."""
    streamed = RawShardSource(str(folders["raw"]), SIZE, seed=0, augment="pad-crop")
    alone = RawShardSource(str(folders["raw"]), SIZE, seed=0, augment="pad-crop")
    batches = np.array_split(np.random.default_rng(1).permutation(18), 2 * RING - 4) + [
        np.array([4, 8, 15, 16, 17])
    ]
    streamed.prefetch("train", 2, batches)
    pointers = set()
    for b in batches:
        slot, host, rows, labels = streamed._take("train", b, CPU)
        assert slot is not None                           # read ahead into the ring, not gathered now
        pointers.add(host.data_ptr())
        assert torch.equal(host, alone.uint8("train", b))
        # the reader wrote the batch's sample indices and labels beside its pixels
        assert rows.tolist() == b.tolist() and torch.equal(labels, alone.labels("train", b))
    assert len(pointers) == RING and len(streamed._reader.rings["train"].pixels) == RING
    streamed.prefetch("train", 2, batches)
    for b in batches:
        torch.testing.assert_close(streamed.images("train", b, CPU, epoch=2),
                                   alone.images("train", b, CPU, epoch=2), rtol=0, atol=0)


def test_read_ahead_ranges_merge_rows_closer_than_4_kib(folders):
    shard = RawShardSource(str(folders["raw"]), SIZE, seed=0).shards["train"][0]
    width = SIZE * SIZE * 3
    first = shard.pieces[0][1].ctypes.data - shard.base
    assert shard.ranges(np.array([4, 0, 1])) == [(first, 2 * width), (first + 4 * width, width)]
    assert shard.ranges(np.array([0, 2])) == [(first, 3 * width)]   # (a gap of one row, 3072 bytes)
    assert shard.ranges(np.array([], dtype=np.int64)) == []
    # A batch's ranges over all the shards it touches, at once: each shard's own.
    source = RawShardSource(str(folders["raw"]), SIZE, seed=0)
    idx = np.array([17, 4, 0, 1, 9, 12, 6, 5, 16])
    starts = source.starts["train"]
    want = [(s, source.shards["train"][s].ranges(idx[(idx >= starts[s]) & (idx < starts[s + 1])] - starts[s]))
            for s in range(len(starts) - 1) if ((idx >= starts[s]) & (idx < starts[s + 1])).any()]
    assert source.gathers["train"].file_ranges(idx) == want and len(want) == 4
    source.read_ahead("train", idx)   # (those ranges asked of the kernel: madvise on each shard's mapping)


def test_convert_between_encodings(folders, tmp_path):
    raw = convert_encoding(
        str(folders["jpeg"]), str(tmp_path / "raw"), "raw", processes=1, log=lambda *_: None
    )
    assert raw["encoding"] == "raw" and raw["settings"]["converted_from"] == "jpeg"
    got = RawShardSource(str(tmp_path / "raw"), SIZE, 0).uint8("train", np.arange(18)).int()
    want = RawShardSource(str(folders["raw"]), SIZE, 0).uint8("train", np.arange(18)).int()
    assert (got - want).abs().float().mean() < 3                            # the JPEGs' pixels, decoded
    back = convert_encoding(
        str(tmp_path / "raw"), str(tmp_path / "jpeg"), "jpeg", processes=1, log=lambda *_: None
    )
    assert back["format"] == "rayconv-shards/2" and "image_shape" not in back
    assert ShardSource(str(tmp_path / "jpeg"), SIZE, 0, 0).train_size == 18
    assert prep.main(["--convert", str(folders["raw"]), "--encoding", "raw", "--out",
                      str(tmp_path / "x")]) == 2


def test_a_jpeg_manifest_without_encoding_reads_as_jpeg(folders, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(folders["jpeg"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["encoding"], manifest["settings"]["encoding"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    src = make_source(Config(data="shards", data_dir=str(old), image_size=SIZE, device="cpu",
                             loader_workers=0, data_on_device="off").validate())
    assert isinstance(src, ShardSource) and src.images("test", np.arange(2), CPU).shape == (2, 3, SIZE, SIZE)


def test_one_gather_reads_rows_of_pieces_at_any_addresses():
    """Shards of several pieces (one empty), an empty shard, each piece an allocation of its own: rows
    in any order, repeated, across them all, are those of the pieces one after another."""
    rng = np.random.default_rng(0)
    piece = lambda n: rng.integers(0, 256, (n, 12), dtype=np.uint8)  # noqa: E731
    layout = [[3, 0, 4], [], [1], [5, 2]]
    shards, arrays = [], []
    for sizes in layout:
        pieces = [(int(sum(sizes[:k])), piece(n), None) for k, n in enumerate(sizes)]
        shards.append(SimpleNamespace(rows=sum(sizes), pieces=pieces, base=0))
        arrays += [p[1] for p in pieces]
    whole = np.concatenate(arrays)
    gather = RowGather(shards)
    idx = np.array([14, 0, 7, 7, 3, 8, 2, 9, 13])
    at, touched = gather.locate(idx)
    out = gather.copy(at, torch.empty((len(idx), 12), dtype=torch.uint8))
    assert np.array_equal(out.numpy(), whole[idx]) and touched.tolist() == [0, 2, 3]
    assert gather.locate(np.array([], np.int64))[0].shape == (0,)
    for bad in (15, -1):
        with pytest.raises(IndexError, match=f"sample {bad} is outside the split's 15 rows"):
            gather.locate(np.array([0, bad]))


def test_gathers_in_flight_at_once_keep_the_order_and_the_pixels(folders):
    """More batches than the ring has buffers, an announcement left mid-way (its gathers still in
    flight, into slots the next announcement's gathers reuse) and another made: every batch equals the
    same batch gathered alone."""
    streamed = RawShardSource(str(folders["raw"]), SIZE, seed=0, augment="pad-crop")
    alone = RawShardSource(str(folders["raw"]), SIZE, seed=0, augment="pad-crop")
    rng = np.random.default_rng(2)
    batches = [rng.choice(18, 5, replace=False) for _ in range(2 * RING + 3)]
    streamed.prefetch("train", 1, batches)
    for b in batches[:3]:
        assert torch.equal(streamed._take("train", b, CPU)[1], alone.uint8("train", b))
    odd = np.array([17, 0, 9])
    assert torch.equal(streamed._take("train", odd, CPU)[1], alone.uint8("train", odd))   # the rest left
    streamed.prefetch("train", 2, batches)
    for b in batches:
        slot, host, _, _ = streamed._take("train", b, CPU)
        assert slot is not None and torch.equal(host, alone.uint8("train", b))


def test_a_raw_shard_that_changed_is_named_before_its_bytes_are_read(folders, tmp_path):
    d = tmp_path / "raw"
    shutil.copytree(folders["raw"], d)
    source = RawShardSource(str(d), SIZE, seed=0)
    p = source.shards["train"][1].path
    mine, others = np.array([5, 6]), np.array([0, 12])    # (shards of 5 rows: 5, 6 in the second)
    p.rename(d / "away")
    assert source.uint8("train", others).shape == (2, SIZE, SIZE, 3)     # other shards read on
    with pytest.raises(DataError, match=f"{p} disappeared during the run"):
        source.uint8("train", np.array([0, 5]))
    shutil.copy(d / "away", p)   # the same bytes back, but another file (inode, mtime)
    source.prefetch("train", 0, [mine])
    with pytest.raises(DataError, match=f"{p} changed"):
        source.images("train", mine, CPU)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        (Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z") if Path(f"/proc/{pid}").exists() else True
    )


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_reader_process_ends_with_its_source_and_names_its_own_end(folders):
    """close() and garbage collection end the process; a process killed mid-run is a one-line DataError
    at the next batch, not a hang; a sample outside the split is an IndexError at its batch."""
    source = RawShardSource(str(folders["raw"]), SIZE, seed=0)
    source.prefetch("train", 0, [np.array([1, 2])])
    pid = source._reader.proc.pid
    assert _alive(pid)
    source.close()
    assert _gone_within(pid, 10)

    source.prefetch("train", 0, [np.array([1, 2]), np.array([3, 99])])
    assert source._take("train", np.array([1, 2]), CPU)[1].shape == (2, SIZE, SIZE, 3)
    with pytest.raises(IndexError, match="sample 99 is outside the split's 18 rows"):
        source._take("train", np.array([3, 99]), CPU)
    pid = source._reader.proc.pid
    del source
    assert _gone_within(pid, 10)

    source = RawShardSource(str(folders["raw"]), SIZE, seed=0)
    source.prefetch("train", 0, [np.array([4])])
    source._take("train", np.array([4]), CPU)
    source._reader.proc.kill()
    source._reader.proc.wait()
    with pytest.raises(DataError, match="the raw shards' reader process ended .*: see the actor's log"):
        source.prefetch("train", 0, [np.array([5]), np.array([6])])
        source._take("train", np.array([5]), CPU)


def test_the_reader_process_ends_when_its_actor_process_dies(folders):
    """A process killed without any clean-up (SIGKILL, as Ray stops an actor) leaves no reader behind:
    the reader ends at the end of its pipe."""
    code = (
        "import os, sys, numpy as np\nfrom rayconv.data.raw_shards import RawShardSource\ns ="
        f" RawShardSource({str(folders['raw'])!r}, {SIZE}, seed=0)\ns.prefetch('train', 0, [np.arange(4)]);"
        " s._take('train', np.arange(4), __import__('torch').device('cpu'))\nprint(s._reader.proc.pid,"
        " flush=True)\nos.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    assert _gone_within(int(out.stdout.split()[0]), 10)

"""Prepared shards in a bucket (``--data-dir s3://...``) read through the node's cache, and
``python -m rayconv.prepare --out s3://...``: against moto's S3 server on loopback (no Ray: prepare's
shards written by this process)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from rayconv import prepare as prep
from rayconv import run
from rayconv.config import Config
from rayconv.data import cache
from rayconv.data.registry import check_source, first_epoch_order, make_source
from rayconv.data.shard_writer import on_processes
from rayconv.errors import DataError
from tests.support.image_folder import write_folder
from tests.support.s3_server import s3_server

SIZE = 32
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """2 classes x 8 train and 2 val PNGs of 32 x 32."""
    return write_folder(tmp_path_factory.mktemp("src"), train=8, val=2, shape=lambda i: (SIZE, SIZE),
                        pixels=lambda rng, c, i, shape: rng.integers(0, 256, shape).astype(np.uint8),
                        grey=False)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(prep, "_on_ray", lambda args, address: on_processes(args, 1))


def _prepare(src: Path, out: str, *flags: str) -> None:
    assert prep.main([str(src), "--out", out, "--size", str(SIZE), "--shard-size", "3", *flags]) == 0


@pytest.fixture(scope="module")
def sets(s3, src, tmp_path_factory):
    """The same raw folder prepared locally and into the bucket (``raw``), and JPEG shards in the bucket."""
    mp = pytest.MonkeyPatch()
    mp.setattr(prep, "_on_ray", lambda args, address: on_processes(args, 1))
    local = tmp_path_factory.mktemp("prepared") / "raw"
    try:
        _prepare(src, str(local), "--encoding", "raw")
        _prepare(src, s3.uri("raw"), "--encoding", "raw")
        _prepare(src, s3.uri("jpeg"), "--encoding", "jpeg")
    finally:
        mp.undo()
    return {"local": local, "raw": s3.uri("raw"), "jpeg": s3.uri("jpeg")}


def _cfg(data_dir, cache_dir, **kw) -> Config:
    base = dict(data="shards", data_dir=str(data_dir), image_size=SIZE, device="cpu", loader_workers=0,
                decode="cpu", data_on_device="off", cache_dir=str(cache_dir))
    return Config(**{**base, **kw}).validate()


def test_prepare_uploads_the_shards_then_the_manifest(s3, sets):
    fs = s3.filesystem()
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{s3.bucket}/raw")))
    assert names == sorted(p.name for p in sets["local"].iterdir())   # the shards and manifest.json, no more
    for name in names:   # prepare is deterministic: the bucket holds the local folder's bytes
        with fs.open_input_stream(f"{s3.bucket}/raw/{name}") as f:
            assert f.read() == (sets["local"] / name).read_bytes(), name
    assert not cache.staging_folder(sets["raw"]).exists()   # the local copy went once uploaded


@pytest.mark.parametrize("kind", ["raw", "jpeg"])
def test_cold_then_warm_cache_gives_the_local_batches(sets, tmp_path, kind):
    cold = make_source(_cfg(sets[kind], tmp_path / "cache"))
    manifest = cache.remote_manifest(sets[kind])[2]
    want = cache.shard_order(manifest, first_epoch_order(_cfg(sets[kind], tmp_path), manifest))
    assert cache.LAST["fetched"] == want and len(want) == 8   # every shard, in the order the run reads them
    warm = make_source(_cfg(sets[kind], tmp_path / "cache"))
    assert cache.LAST["fetched"] == []                      # the second opening fetches nothing
    local = make_source(_cfg(sets["local"], tmp_path)) if kind == "raw" else None
    for split, epoch, idx in (("train", 1, np.array([5, 0, 11, 3, 15])), ("test", 0, np.array([3, 0, 2]))):
        a = cold.images(split, idx, CPU, epoch=epoch)
        assert torch.equal(a, warm.images(split, idx, CPU, epoch=epoch))
        if local is not None:
            assert torch.equal(a, local.images(split, idx, CPU, epoch=epoch))
    assert torch.equal(cold.labels("train", np.arange(16)), warm.labels("train", np.arange(16)))
    for src in (cold, warm, local):
        getattr(src, "close", lambda: None)()
    cache.release()


@pytest.mark.parametrize("kind,on_device", [("raw", "off"), ("jpeg", "off"), ("raw", "auto"), ("jpeg", "on")])
def test_the_drivers_checks_read_the_manifest_alone(sets, tmp_path, kind, on_device):
    from rayconv.driver.resolve import check_before_ray

    cfg = _cfg(sets[kind], tmp_path / "cache", val_split=0.25, augment="pad-crop", data_on_device=on_device,
               model="convnet", global_batch_size=4, steps=2)
    cache.LAST.clear()
    source, sharding = check_before_ray(cfg, None)[:2]
    assert not list((tmp_path / "cache").rglob("*.arrow")) and cache.LAST == {}   # the driver fetched nothing
    from rayconv.planner.measure import profile_of
    assert sum(profile_of(cfg.to_dict())["params"]) > 0   # the planner's measure takes the shapes alone too
    assert not list((tmp_path / "cache").rglob("*.arrow")) and cache.LAST == {}
    opened = make_source(cfg)   # what an actor opens: the set fetched into its node's cache
    assert len(list((tmp_path / "cache").rglob("*.arrow"))) == 8
    for attr in ("num_classes", "sample_shape", "train_size", "test_size", "manifest", "augmentation",
                 "expanded_from", "name"):
        assert getattr(source, attr) == getattr(opened, attr), attr
    assert sharding.train_samples == 12 and source.describe() == opened.describe()
    getattr(opened, "close", lambda: None)()
    cache.release()


def test_a_set_larger_than_cache_bytes_is_refused_by_the_driver_before_any_fetch(sets, tmp_path):
    with pytest.raises(DataError, match=r"raise --cache-bytes .* \(--stage-dir\)$") as e:
        check_source(_cfg(sets["raw"], tmp_path / "cache", cache_bytes=1000))
    assert "\n" not in str(e.value) and not (tmp_path / "cache").exists()
    staged = _cfg(sets["raw"], tmp_path / "cache", cache_bytes=1000, stage_dir=str(tmp_path / "s"))
    assert check_source(staged).train_size == 16   # --stage-dir: read from there, no cache budget asked


def test_the_cache_keeps_within_cache_bytes(s3, sets, tmp_path):
    fs = s3.filesystem()
    pafs.copy_files(f"{s3.bucket}/raw", f"{s3.bucket}/raw2", source_filesystem=fs, destination_filesystem=fs)
    one = cache.ShardCache(sets["raw"], str(tmp_path)).set_bytes
    budget = one + one // 2   # one set fits, two do not
    first = cache.ShardCache(sets["raw"], str(tmp_path), budget)
    first.ready()
    second = cache.ShardCache(s3.uri("raw2"), str(tmp_path), budget)
    with pytest.raises(DataError, match="held by sets in use"):   # the first set is read by this process
        second.ready()
    cache.release()
    second.ready()
    assert second.evicted == [first.folder.name] and not first.folder.exists()
    assert second.used() <= budget
    cache.release()
    with pytest.raises(DataError, match=r"holds .* more than --cache-bytes 1000 ") as e:
        cache.ShardCache(sets["raw"], str(tmp_path), 1000).ready()
    assert "\n" not in str(e.value)


def test_two_fetchers_of_one_set_on_a_node_fetch_each_shard_once(sets, tmp_path):
    caches = [cache.ShardCache(sets["raw"], str(tmp_path)) for _ in range(2)]
    threads = [threading.Thread(target=c.ready) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(caches[0].fetched + caches[1].fetched) == sorted(caches[0].entries)
    assert caches[0].folder == caches[1].folder and (caches[0].folder / "manifest.json").is_file()
    cache.release()


def test_a_shard_that_does_not_match_its_manifest_is_named(s3, sets, tmp_path):
    fs = s3.filesystem()
    pafs.copy_files(f"{s3.bucket}/raw", f"{s3.bucket}/bad", source_filesystem=fs, destination_filesystem=fs)
    with fs.open_input_stream(f"{s3.bucket}/bad/train-00001.arrow") as f:
        data = bytearray(f.read())
    data[100] ^= 1
    with fs.open_output_stream(f"{s3.bucket}/bad/train-00001.arrow") as f:
        f.write(bytes(data))
    with pytest.raises(DataError, match=r"train-00001.arrow does not match its size and sha256"):
        cache.ShardCache(s3.uri("bad"), str(tmp_path)).ready()
    assert not list((tmp_path).glob("*/train-00001.arrow"))   # nothing unchecked under its name


def test_bad_locations_are_one_line_exit_2_before_ray(s3, sets, tmp_path, capsys, monkeypatch):
    import ray
    if ray.is_initialized():   # (an earlier module's cluster: the check below is of these commands)
        ray.shutdown()

    def failing(data_dir: str, *flags: str) -> str:
        capsys.readouterr()
        assert run.main(["--data-dir", data_dir, *flags, "--steps", "1", "--no-progress", "--device", "cpu",
                         "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rayconv: error:"), err
        return err[0]

    assert "the bucket nobucket does not exist" in failing("s3://nobucket/raw")
    assert "has no manifest.json" in failing(s3.uri("nothing-here"))
    assert "has no manifest.json" in failing(s3.uri("nothing-here"), "--data", "shards")
    assert "--cache-bytes 0: give a positive byte count" in failing(sets["raw"], "--cache-bytes", "0")
    assert "(--stage-dir)" in failing(sets["raw"], "--cache-bytes", "1000")
    from rayconv.data_dir import check_cache_bytes
    check_cache_bytes(sets["raw"], 1000, str(tmp_path / "stage"))   # (--stage-dir: no cache, no refusal)
    from rayconv import prepare
    capsys.readouterr()   # prepare into a missing bucket: refused before any image is encoded
    assert prepare.main([str(tmp_path / "no-images-read"), "--out", "s3://nobucket/shards"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the bucket nobucket does not exist" in err[0], err
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # (nothing listens there)
    assert "the storage cannot be read" in failing("s3://b/raw")
    assert not ray.is_initialized() and not (tmp_path / "x").exists()


def test_stage_dir_copies_from_a_bucket(sets, tmp_path):
    from rayconv.cluster.local_copy import copy_folder

    first = copy_folder(sets["raw"], str(tmp_path / "stage"))
    assert len(first["copied"]) == 8 and first["skipped"] == []
    names = sorted(p.name for p in sets["local"].iterdir())
    assert sorted(p.name for p in (tmp_path / "stage").iterdir()) == names
    for p in sets["local"].iterdir():
        assert (tmp_path / "stage" / p.name).read_bytes() == p.read_bytes(), p.name
    again = copy_folder(sets["raw"], str(tmp_path / "stage"))
    assert again["copied"] == [] and len(again["skipped"]) == 8


def test_a_shard_gone_from_the_cache_is_fetched_again(sets, tmp_path):
    first = cache.ShardCache(sets["raw"], str(tmp_path))
    folder = first.ready()
    (folder / "train-00002.arrow").unlink()
    again = cache.ShardCache(sets["raw"], str(tmp_path))
    assert again.ready() == folder and again.fetched == ["train-00002.arrow"]
    cache.release()


def _next_use(reads: list[frozenset], at: int, name: str) -> float:
    return next((j for j in range(at, len(reads)) if name in reads[j]), float("inf"))


@pytest.mark.parametrize("kind", ["raw", "jpeg"])
def test_a_set_larger_than_the_cache_streams_within_cache_bytes_in_belady_order(sets, tmp_path, kind):
    from rayconv.data.source import Sharding

    local_cfg = _cfg(sets["local"], tmp_path, augment="pad-crop")
    local = make_source(local_cfg) if kind == "raw" else None
    whole = make_source(_cfg(sets[kind], tmp_path / "whole", augment="pad-crop"))   # fetched whole
    one = cache.ShardCache(sets[kind], str(tmp_path))
    budget = one.set_bytes // 2   # about 4 of the 8 shards: a batch of 2 reads at most 2
    src = make_source(_cfg(sets[kind], tmp_path / "cache", cache_bytes=budget, augment="pad-crop"))
    stream = src.stream
    assert stream is not None and stream.share() == budget
    sharding = Sharding(src.train_size, 2, 0)
    steps = sharding.steps_per_epoch
    epochs = [[sharding.replica_batch(e, s, 0, 1)[0] for s in range(steps)] for e in (0, 1)]
    reads, seen = [], []
    for epoch, batches in enumerate(epochs):   # as actor.batches announces: this epoch, the next foreseen
        src.prefetch("train", epoch, batches)
        if epoch == 0:
            src.foresee("train", 1, epochs[1])
        for idx in batches:
            reads.append(src.files("train", idx))
            x = src.images("train", idx, CPU, epoch=epoch)
            assert torch.equal(x, whole.images("train", idx, CPU, epoch=epoch))
            if local is not None:
                assert torch.equal(x, local.images("train", idx, CPU, epoch=epoch))
            assert stream.used() <= budget
            seen.append(len(stream.events))
    assert torch.equal(src.labels("train", np.arange(16)), whole.labels("train", np.arange(16)))
    kinds = [e[0] for e in stream.events]
    assert kinds.count("evict") >= 4 and kinds.count("fetch") > len(stream.shards)   # fetched again
    for what, name, used, done, candidates in stream.events:
        assert used <= budget, (what, name, used)
        if what == "evict":   # the furthest next use of those it could evict (Belady)
            assert name in candidates
            assert _next_use(reads, done, name) == max(_next_use(reads, done, c) for c in candidates)
    assert all(sh.open is None for sh in stream.shards.values() if sh.name not in reads[-1])
    for sh in stream.shards.values():   # every fetched file as in the bucket
        if (stream.folder / sh.name).is_file():
            assert (stream.folder / sh.name).read_bytes() == (whole.root / sh.name).read_bytes()
    for s in (src, whole, local):
        getattr(s, "close", lambda: None)()
    cache.release()


def test_a_batch_larger_than_the_cache_is_refused_in_one_line(sets, tmp_path):
    from rayconv.driver.resolve import check_before_ray

    one = cache.ShardCache(sets["raw"], str(tmp_path))
    big = max(int(e["bytes"]) for e in one.entries.values())
    cfg = _cfg(sets["raw"], tmp_path / "cache", cache_bytes=2 * big, global_batch_size=8, model="convnet",
               steps=2)
    with pytest.raises(DataError, match=r"raise --cache-bytes to at least \d+, use --shuffle block") as e:
        check_before_ray(cfg, None)
    assert "\n" not in str(e.value) and not list((tmp_path / "cache").rglob("*.arrow"))
    src = make_source(cfg)   # an actor's own check, where the driver's did not run
    with pytest.raises(DataError, match=r"one batch reads \d shards .* raise --cache-bytes"):
        src.prefetch("train", 0, [np.arange(8)])
    src.close()
    cache.release()


def test_two_streams_of_a_node_share_cache_bytes_and_end_with_their_sources(sets, tmp_path):
    budget = cache.ShardCache(sets["raw"], str(tmp_path)).set_bytes // 2
    cfg = _cfg(sets["raw"], tmp_path / "cache", cache_bytes=budget)
    a, b, whole = make_source(cfg), make_source(cfg), make_source(_cfg(sets["raw"], tmp_path / "whole"))
    order = [np.array([i]) for i in range(16)]
    a.prefetch("train", 0, order)
    b.prefetch("train", 0, order[::-1])
    assert a.stream.share() == b.stream.share() == budget // 2   # two streams of the set on this node
    for x, y in zip(order, order[::-1]):
        assert torch.equal(a.images("train", x, CPU), whole.images("train", x, CPU))
        assert torch.equal(b.images("train", y, CPU), whole.images("train", y, CPU))
        assert a.stream.used() <= budget
    assert all(e[2] <= budget for e in a.stream.events + b.stream.events)
    folder = a.stream.folder
    del a
    import gc
    gc.collect()
    assert not folder.exists() and b.stream.folder.exists()   # a source collected: its stream's folder goes
    b.close()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    cache.release()

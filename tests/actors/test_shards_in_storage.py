"""Training from prepared shards in a bucket (``--data-dir s3://...``) on a real local Ray cluster (gloo,
float64): moto's S3 server on loopback, its client environment in this process and so in every Ray worker
the cluster started here. The bucket's shards are read through each node's cache (fetched by the actors,
never by the driver); the parameters equal single-device SGD on the local folder, with an empty cache and
with a warm one."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from support.helpers import assert_same_state, reference_sgd
from rayconv import prepare as prep
from rayconv.config import Config
from rayconv.data import cache
from rayconv.data.shard_writer import on_processes
from rayconv.driver.job import train_run
from tests.support.image_folder import write_folder
from tests.support.s3_server import s3_server

SIZE = 32


@pytest.fixture(scope="module")
def s3_and_ray():
    """The S3 server, then a fresh 4-CPU Ray cluster whose workers inherit its client environment."""
    with s3_server() as server:
        if ray.is_initialized():
            ray.shutdown()
        ray.init(num_cpus=4, include_dashboard=False, namespace="rayconv", log_to_driver=False,
                 configure_logging=True, logging_level="WARNING")
        try:
            yield server
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def folders(s3_and_ray, tmp_path_factory):
    """3 classes x 6 train and 2 val PNGs prepared as raw pixels (3 a shard) here and into the bucket."""
    def tinted(rng, c, i, shape):   # (each class brighter in its own channel)
        px = rng.integers(0, 90, shape).astype(np.uint8)
        px[..., c] += 160
        return px

    root = write_folder(tmp_path_factory.mktemp("src"), train=6, val=2, classes="abc", grey=False,
                        shape=lambda i: (SIZE, SIZE), pixels=tinted)
    local = tmp_path_factory.mktemp("prepared") / "raw"
    mp = pytest.MonkeyPatch()
    mp.setattr(prep, "_on_ray", lambda args, address: on_processes(args, 1))
    try:
        for out in (str(local), s3_and_ray.uri("raw")):
            assert prep.main([str(root), "--out", out, "--size", str(SIZE), "--shard-size", "3",
                              "--encoding", "raw"]) == 0
    finally:
        mp.undo()
    return {"local": local, "bucket": s3_and_ray.uri("raw")}


def _cfg(data_dir, out, **kw) -> Config:
    # 18 train images, global batch 6: 3 steps an epoch; 4 steps cross an epoch boundary.
    base = dict(model="convnet", data="shards", data_dir=str(data_dir), image_size=SIZE, dp=2,
                global_batch_size=6, steps=4, lr=0.05, momentum=0.9, weight_decay=5e-4, precision="fp64",
                device="cpu", progress=False, eval_every=4, loader_workers=0, data_on_device="off",
                out=str(out))
    return Config(**{**base, **kw}).validate()


@pytest.mark.slow
def test_dp2_from_a_bucket_equals_single_device_sgd_cold_and_warm(folders, tmp_path):
    budget = 2 * sum(p.stat().st_size for p in folders["local"].iterdir())
    cold = _cfg(folders["bucket"], tmp_path / "cold", cache_dir=str(tmp_path / "cache"), cache_bytes=budget)
    cache.LAST.clear()
    train_run(cold, log=lambda *_: None)
    assert cache.LAST == {}   # the driver's checks read the manifest alone: only the actors fetched
    got = torch.load(tmp_path / "cold" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(_cfg(folders["local"], tmp_path / "ref", dp=1), 4), atol=1e-10)
    held = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*/*")}
    assert len(held) == 9 and sum(p.stat().st_size for p in held) <= budget   # 8 shards and the manifest
    cache.release()
    warm = _cfg(folders["bucket"], tmp_path / "warm", cache_dir=str(tmp_path / "cache"), cache_bytes=budget)
    train_run(warm, log=lambda *_: None)
    again = torch.load(tmp_path / "warm" / "model.pt", weights_only=True)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    assert {p: p.stat().st_mtime_ns for p in held} == held   # nothing fetched again
    assert sorted((tmp_path / "cache").glob("*/*")) == sorted(held)
    cache.release()


@pytest.mark.slow
def test_dp2_streams_a_set_larger_than_cache_bytes_to_single_device_sgd(folders, tmp_path):
    shards = sum(p.stat().st_size for p in folders["local"].iterdir())
    budget = 3 * shards // 4   # the set does not fit: each of the two actors streams through half of this
    kw = dict(shuffle="block", shuffle_window=1, steps=6)
    cfg = _cfg(folders["bucket"], tmp_path / "run", cache_dir=str(tmp_path / "cache"), cache_bytes=budget,
               **kw)
    train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(_cfg(folders["local"], tmp_path / "ref", dp=1, **kw), 6), atol=1e-10)
    # one stream a reading actor (kept with the actor until its next run), nothing fetched whole
    folders = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(folders) == 2 and all(".s" in p.name for p in folders), folders
    held = [p for p in (tmp_path / "cache").glob("*/*") if p.is_file()]
    assert sum(p.stat().st_size for p in held) <= budget and len(held) < 8


# (last: its run fails, which ends the actors that the runs before it kept for each other)
@pytest.mark.slow
def test_a_bad_shard_found_by_an_actor_stops_the_run_in_one_line(s3_and_ray, folders, tmp_path, capsys):
    import pyarrow.fs as pafs

    from rayconv import run

    s3, fs = s3_and_ray, s3_and_ray.filesystem()
    pafs.copy_files(f"{s3.bucket}/raw", f"{s3.bucket}/bad", source_filesystem=fs, destination_filesystem=fs)
    with fs.open_input_stream(f"{s3.bucket}/bad/train-00001.arrow") as f:
        data = bytearray(f.read())
    data[100] ^= 1
    with fs.open_output_stream(f"{s3.bucket}/bad/train-00001.arrow") as f:
        f.write(bytes(data))
    capsys.readouterr()
    rc = run.main(["--data-dir", s3.uri("bad"), "--model", "convnet", "--dp", "2", "--steps", "1",
                   "--no-progress", "--device", "cpu", "--image-size", str(SIZE), "--global-batch-size", "6",
                   "--loader-workers", "0", "--cache-dir", str(tmp_path / "cache"), "--out",
                   str(tmp_path / "out"), "--address", "auto"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1, err
    assert "train-00001.arrow does not match its size and sha256" in err[0] and "failed in build" in err[0]
    assert not list((tmp_path / "cache").glob("*/train-00001.arrow"))   # nothing unchecked under its name

"""Checkpoints written by the actors in the background (driver/saving.py, actor/saver.py), on a real local
Ray cluster and a real S3-compatible server on loopback (moto): each tensor written once over the
data-parallel replicas; resumed (from a folder or a bucket, under the same layout or another) they
continue to single-device SGD's parameters; a server that stops mid-run costs that checkpoint only
(one line), and nothing without a manifest is ever resumed."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import local_ray
from support.helpers import assert_same_state, checkpoint_config, reference_sgd
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.outputs.checkpoint import list_checkpoints, load_checkpoint
from rayconv.run import main
from rayconv.storage import locate
from tests.support.s3_server import s3_server

STEPS = 4


class Stop(Exception):
    """Raised from on_step to end a run mid-way, as a crash would."""


def config(out, **kw) -> Config:
    return checkpoint_config(out, steps=kw.pop("steps", STEPS), **kw)


@pytest.fixture(scope="module")
def s3():
    """The S3 server, started before this module's own Ray cluster, whose actors inherit its endpoint
    and test credentials from the environment."""
    with s3_server() as server:
        yield from _with_ray(server)


def _with_ray(server):
    for _ in local_ray(4):
        yield server


@pytest.fixture(scope="module")
def want() -> dict[str, torch.Tensor]:
    return reference_sgd(config("unused", dp=1), STEPS)


def part_bytes(ckpt) -> tuple[int, int]:
    """(bytes of the checkpoint's rank files, bytes of one replica's whole state: rank 0's)."""
    files = sum(f["bytes"] for f in ckpt.manifest["files"] if f["name"].startswith("rank-"))
    return files, len(ckpt.rank_file(0))


@pytest.fixture(scope="module")
def stopped(s3, tmp_path_factory) -> Path:
    """A dp2 run to a local folder, stopped by an error after its checkpoint at step 2."""
    out = tmp_path_factory.mktemp("cks") / "dp2"

    def crash(actor_group, step):
        if step == 1:
            raise Stop()

    with pytest.raises(Stop):
        train_run(config(out), log=lambda *_: None, on_step=crash)
    return out


# (first: the run of the ``stopped`` fixture ends in an error, which stops the two actors it started; the
# dp4 run's four actors, kept (--keep-actors-s), then serve each later run, of one or two actors)
def test_a_dp2_checkpoint_holds_each_tensor_once(stopped):
    ckpt = load_checkpoint(stopped)
    assert ckpt.step == 2 and ckpt.manifest["format"] == 2
    written, one_replica = part_bytes(ckpt)
    assert written <= 1.05 * one_replica, (written, one_replica)
    # both replicas wrote (the writing split between them), and each rebuilt rank holds the whole state
    sizes = [f["bytes"] for f in ckpt.manifest["files"] if f["name"].startswith("rank-")]
    assert len(sizes) == 2 and min(sizes) > 0.3 * one_replica
    assert_same_state(ckpt.payloads()[1]["model"], ckpt.payloads()[0]["model"], atol=0)
    assert not [p for p in (stopped / "checkpoints").rglob("*") if ".tmp" in p.name]


@pytest.mark.slow
def test_dp4_checkpoint_in_a_bucket_holds_each_tensor_once_and_resumes(s3, want, tmp_path):
    """A dp4 run with --out in the bucket: its checkpoints are the bucket's (each tensor once: one
    replica's state in bytes), and resuming one from the bucket under dp2 ends at single-device SGD."""
    uri = s3.uri("runs", "dp4")
    train_run(config(uri, dp=4), log=lambda *_: None)
    assert [p.name for p in list_checkpoints(uri)] == ["step-2", "step-4"]
    ckpt = load_checkpoint(uri + "/checkpoints/step-2")
    written, one_replica = part_bytes(ckpt)
    assert written <= 1.05 * one_replica, (written, one_replica)
    out = tmp_path / "from-bucket"
    assert main(["--resume", uri + "/checkpoints/step-2", "--dp", "2", "--out", str(out)]) == 0
    assert_same_state(torch.load(out / "model.pt", weights_only=True), want, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [[], ["--dp", "1"]], ids=["same-layout", "dp1"])
def test_resume_equals_single_device_sgd(stopped, want, argv, tmp_path):
    out = tmp_path / "resumed"
    assert main(["--resume", str(stopped), *argv, "--out", str(out)]) == 0
    assert_same_state(torch.load(out / "model.pt", weights_only=True), want, atol=1e-10)


@pytest.mark.slow
def test_a_server_stopped_mid_run_costs_that_checkpoint_only(s3, tmp_path):
    """The server stops after the checkpoint of step 4 and comes back once that of step 5 (the last
    step's) failed: that failure is one line (after the actors' retries), step-4 stays the newest
    complete checkpoint with nothing of step 5 listed, the run ends, and resuming the bucket's run
    continues from step 4 to single-device SGD's parameters."""
    uri = s3.uri("runs", "down")
    lines: list[str] = []

    def hook(actor_group, step):
        if step == 3:    # (done 4: its checkpoint complete)
            s3.stop()
        if step == 4:    # (done 5: its checkpoint failed and was reported)
            s3.start()

    try:
        train_run(config(uri, steps=5), log=lines.append, on_step=hook)
    finally:
        s3.start()
    failed = [x for x in lines if "checkpoint" in x and "not written" in x]
    assert len(failed) == 1 and "\n" not in failed[0], lines
    assert "checkpoint of step 5 not written" in failed[0] and "step-4" in failed[0], failed
    assert [p.name for p in list_checkpoints(uri)] == ["step-2", "step-4"]
    out = tmp_path / "again"
    assert main(["--resume", uri, "--out", str(out)]) == 0
    want = reference_sgd(config("unused", dp=1, steps=5), 5)
    assert_same_state(torch.load(out / "model.pt", weights_only=True), want, atol=1e-10)


def test_a_failed_runs_event_files_are_in_the_bucket_and_not_on_the_disk(s3, tmp_path, monkeypatch):
    """A run into the bucket stopped by an error after its checkpoint of step 2: when the error reaches
    the caller, whose traceback still holds the run, TensorBoard's event file is in the bucket and its
    local copy (a temporary folder) is gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # (where the local copy is made)
    uri = s3.uri("runs", "events")

    def crash(actor_group, step):
        if step == 1:
            raise Stop()

    with pytest.raises(Stop) as caught:
        train_run(config(uri, steps=3), log=lambda *_: None, on_step=crash)
    assert caught.tb is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rayconv-tensorboard-")] == []
    events = locate(uri + "/tensorboard").listdir()
    assert len(events) == 1 and events[0].startswith("events.out.tfevents."), events


def test_a_step_folder_without_manifest_is_never_resumed(stopped, s3, tmp_path):
    """Rank files of a checkpoint whose manifest never came (an upload cut short), on a disk and in the
    bucket: not listed, not resumed, refused in one line when named, removed at the next checkpoint."""
    from rayconv.errors import CheckpointError
    from rayconv.outputs.checkpoint import find_checkpoint, remove_partial
    for root in (locate(tmp_path / "run"), locate(s3.uri("runs", "partial"))):
        good, partial = root / "checkpoints" / "step-2", root / "checkpoints" / "step-4"
        for f in (stopped / "checkpoints" / "step-2").iterdir():
            (good / f.name).write_bytes(f.read_bytes())
            if f.name != "manifest.json":
                (partial / f.name).write_bytes(f.read_bytes())
        assert [p.name for p in list_checkpoints(root)] == ["step-2"]
        assert load_checkpoint(root).step == 2
        with pytest.raises(CheckpointError, match="never finished"):
            find_checkpoint(partial)
        assert remove_partial(root) == ["step-4"] and not partial.exists() and good.exists()
    assert json.loads((stopped / "checkpoints" / "step-2" / "manifest.json").read_text())["format"] == 2


def test_rank_files_reach_a_local_folder_through_the_drivers_node(s3, tmp_path, monkeypatch):
    """An actor on another node than a local --out's: its rank file streams in pieces to a writer on the
    driver's node (cluster/sink.py), whole or absent, with the size and sha256 the manifest lists."""
    import hashlib
    import io

    import ray

    from rayconv.actor.saver import write_rank_file
    from rayconv.cluster import sink
    assert sink.needs_sink(True, "a", ["a", "b"]) == [False, True]
    assert sink.needs_sink(False, "a", ["a", "b"]) == [False, False]   # (a bucket: every actor writes)
    monkeypatch.setattr(sink, "PIECE_BYTES", 1000)   # (many pieces)
    writer = sink.start_sink(ray.get_runtime_context().get_node_id())
    obj = {"tensors": {"w": torch.arange(5000, dtype=torch.float64)}}
    meta = write_rank_file(sink.SinkFolder(writer, str(tmp_path / "step-2")) / "rank-1.pt", obj)
    data = (tmp_path / "step-2" / "rank-1.pt").read_bytes()
    assert meta == {"name": "rank-1.pt", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["tensors"]["w"], obj["tensors"]["w"])
    with pytest.raises(RuntimeError):   # a write that fails half-way leaves nothing
        with (sink.SinkFolder(writer, str(tmp_path / "step-4")) / "rank-0.pt").stream() as f:
            f.write(b"x" * 5000)
            raise RuntimeError("cut")
    assert list((tmp_path / "step-4").iterdir()) == []
    ray.kill(writer)

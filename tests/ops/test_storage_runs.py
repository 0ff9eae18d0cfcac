"""Runs whose folder is a bucket of a real S3-compatible server on loopback (moto), on a Ray head of
this module's own that has the server's environment (as a cloud cluster's nodes have their
credentials): a dp2 x pp2 driver SIGKILLed mid-run continues with ``--resume s3://...`` from another
working folder, under another layout (dp4), to single-device SGD's parameters (float64, 1e-10), and
under its own layout from an older checkpoint to the killed run's own checkpoint, bit for bit (on the
four actors the dp4 command kept on the head: the same count and bundle); the results
(config.json, metrics.parquet, summary.json, model.pt, checkpoints) are in the bucket and nothing is
written to the working folders."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.helpers import assert_same_state, reference_sgd, sgd_config
from rayconv.outputs.checkpoint import list_checkpoints, whole_state
from rayconv.storage import locate
from tests.support.ray_head import own_head
from tests.support.s3_server import s3_server

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 20, 4
RUN = ["--model", "convnet", "--data", "digits", "--global-batch-size", "96", "--lr", "0.05",
       "--momentum", "0.9", "--weight-decay", "5e-4", "--precision", "fp64", "--device", "cpu",
       "--no-progress", "--loader-workers", "0", "--steps", str(STEPS), "--eval-every", "1000",
       "--checkpoint-every", str(EVERY), "--keep-checkpoints", "0"]


@pytest.fixture(scope="module")
def cluster():
    """(the S3 server, the Ray head's address): the head's nodes get the server's environment."""
    with s3_server() as s3, own_head("--num-cpus", "4", "--include-dashboard", "false", env=s3.env,
                                     prefix="rcs-") as ports:
        yield s3, f"127.0.0.1:{ports['--port']}"


def command(address: str, *argv: str) -> list[str]:
    return [sys.executable, "-m", "rayconv.run", "--address", address, *argv]


def run(cwd: Path, args: list[str]) -> str:
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(cwd.iterdir()) == []   # everything went to the bucket
    return r.stdout


def model(where) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO((locate(where) / "model.pt").read_bytes()), weights_only=True)


@pytest.mark.slow
def test_a_lost_driver_continues_from_the_bucket(cluster, tmp_path):
    s3, address = cluster
    r1 = s3.uri("storage-runs", "r1")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (tmp_path / "first").mkdir()
    first = subprocess.Popen(command(address, *RUN, "--dp", "2", "--pp", "2", "--num-microbatches", "2",
                                     "--out", r1),
                             cwd=tmp_path / "first", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 300
    while len(list_checkpoints(locate(r1))) < 2:   # (step-4 and step-8 complete: their manifests written)
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "two checkpoints within 300 s"
        time.sleep(0.1)
    first.kill()                                      # the driver lost mid-run (SIGKILL)
    first.communicate()
    assert not (locate(r1) / "summary.json").exists() and list(Path(tmp_path / "first").iterdir()) == []
    killed_at = [int(p.name.split("-")[1]) for p in list_checkpoints(locate(r1))]
    assert killed_at[-1] < STEPS

    # (a) resumed from the bucket in another working folder, under another layout: single-device SGD
    out = run(tmp_path / "second", command(address, "--resume", r1, "--dp", "4", "--pp", "1"))
    assert f"-> {r1}" in out and "resuming from" in out
    want = reference_sgd(sgd_config(tmp_path, "ref", steps=STEPS), STEPS)
    assert_same_state(model(r1), want, atol=1e-10)
    summary = json.loads((locate(r1) / "summary.json").read_text())
    assert summary["out"] == r1 and summary["steps_done"] == STEPS and summary["layout"]["pp"] == 1
    assert json.loads((locate(r1) / "config.json").read_text())["out"] == r1
    assert (locate(r1) / "metrics.parquet").is_file()

    # (c) under its own layout, from the killed run's older checkpoint, into another folder: its next
    # checkpoint is the killed run's, bit for bit (read from the bucket without Ray); its actors are the
    # ones (a) kept, stopped at its end (the search's trial needs the CPUs)
    r2 = s3.uri("storage-runs", "r2")
    older, newer = killed_at[:2]
    out = run(tmp_path / "third", command(address, "--resume", f"{r1}/checkpoints/step-{older}", "--out", r2,
                                          "--keep-actors-s", "0"))
    got, was = whole_state(f"{r2}/checkpoints/step-{newer}"), whole_state(f"{r1}/checkpoints/step-{newer}")
    assert_same_state(got["model"], was["model"], atol=0)
    assert_same_state(model(r2), want, atol=1e-10)


@pytest.mark.slow
def test_a_search_in_the_bucket(cluster, tmp_path):
    """``python -m rayconv.tune --out s3://...``: Tune's state, each trial's run folder and log, and the
    results are in the bucket; nothing in the working folder."""
    s3, address = cluster
    s1 = s3.uri("storage-searches", "s1")
    search = ["--space", '{"lr": {"grid": [0.05]}}', "--scheduler", "fifo", "--address", address,
              "--dp", "1", "--steps", "4", "--eval-every", "2", "--global-batch-size", "96",
              "--device", "cpu", "--no-progress", "--out", s1]
    out = run(tmp_path / "search", [sys.executable, "-m", "rayconv.tune", *search])
    assert f"-> {s1}" in out, out
    where = locate(s1)
    assert {"search.json", "results.json", "results.csv", "tune", "trial-0", "logs"} <= set(where.listdir())
    results = json.loads((where / "results.json").read_text())
    assert [t["status"] for t in results["trials"]] == ["finished"], results
    assert json.loads((where / "trial-0" / "summary.json").read_text())["out"] == f"{s1}/trial-0"
    assert "done:" in (where / "logs" / "trial-0.log").read_text()
    again = run(tmp_path / "again", [sys.executable, "-m", "rayconv.tune", "--resume", s1])   # (Tune's state)
    assert f"resuming {s1}" in again and "finished" in again, again

"""Checkpoints queued behind their step (driver/saving.py), on a real local Ray cluster (float64, dp=2): at
a boundary where nothing else needs the actors quiet the driver lets none go quiet (no ``flush``: the
actors' calls run ``train_step``, ``checkpoint_start``, ``train_step``), each checkpoint's
metrics.parquet holds exactly the steps before it, and a run resumed from each ends at the uninterrupted
run's parameters (resumed in its own folder, a step folder written again is emptied first); a checkpoint
begun while the one before it is still being written (a write that fails and is tried again:
actor/saver.py) completes after it, every checkpoint in order."""

from __future__ import annotations

import io
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import rayconv.driver.loop as loop
from support.helpers import assert_same_state, checkpoint_config, reference_sgd
from rayconv.cluster.group import ActorGroup
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.outputs.checkpoint import list_checkpoints, load_checkpoint
from rayconv.run import main

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 6


def config(out, **kw) -> Config:
    return checkpoint_config(out, steps=kw.pop("steps", STEPS), **kw)


def rows(parquet: bytes, kind: str = "train") -> list[dict]:
    return [r for r in pq.read_table(io.BytesIO(parquet)).to_pylist() if r["kind"] == kind]


@pytest.fixture(scope="module")
def want() -> dict[str, torch.Tensor]:
    return reference_sgd(config("unused", dp=1), STEPS)


@pytest.fixture(scope="module")
def queued(ray_cluster, tmp_path_factory) -> tuple[Path, list[tuple[str, object]]]:
    """A run with checkpoints at steps 2, 4 (nothing else due: queued) and 6 (the last: drained), and
    the calls the driver made to its actors in order (method, first argument)."""
    out = tmp_path_factory.mktemp("queued") / "run"
    calls: list[tuple[str, object]] = []
    submit = ActorGroup.submit_each

    def recorded(self, method, args, ranks=None):
        calls.append((method.__name__, args[0][0] if args and args[0] else None))
        return submit(self, method, args, ranks)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ActorGroup, "submit_each", recorded)
        train_run(config(out), log=lambda *_: None)
    return out, calls


def test_a_checkpoint_with_nothing_else_due_does_not_drain_the_steps(queued, want):
    out, calls = queued
    steps = [c for c in calls if c[0] in ("train_step", "checkpoint_start", "flush")]
    for k in (2, 4):   # step k-1's call, the checkpoint's right behind it, then step k's: no flush
        at = steps.index(("train_step", k - 1))
        assert steps[at:at + 3] == [("train_step", k - 1), ("checkpoint_start", k), ("train_step", k)], steps
    at = steps.index(("train_step", STEPS - 1))   # the last step's: the actors quiet first
    assert steps[at:at + 3] == [("train_step", STEPS - 1), ("flush", None), ("checkpoint_start", STEPS)]
    assert [p.name for p in list_checkpoints(out)] == ["step-2", "step-4", "step-6"]
    assert_same_state(torch.load(out / "model.pt", weights_only=True), want, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_resumed_from_each_queued_checkpoint_a_run_ends_where_the_run_did(queued, k, tmp_path):
    """The checkpoint's metrics.parquet: the steps before it, as the run recorded them; resumed, the run
    ends at the uninterrupted run's parameters with every step's row."""
    out, _ = queued
    ckpt = out / "checkpoints" / f"step-{k}"
    straight = rows((out / "metrics.parquet").read_bytes())
    saved = rows((ckpt / "metrics.parquet").read_bytes())
    assert [r["step"] for r in saved] == list(range(k)) and saved == straight[:k]
    assert not rows((ckpt / "metrics.parquet").read_bytes(), "eval")
    branch = tmp_path / "branch"
    assert main(["--resume", str(ckpt), "--out", str(branch)]) == 0
    assert_same_state(torch.load(branch / "model.pt", weights_only=True),
                      torch.load(out / "model.pt", weights_only=True), atol=1e-10)
    assert [r["step"] for r in rows((branch / "metrics.parquet").read_bytes())] == list(range(STEPS))


@pytest.mark.slow
def test_resumed_in_its_folder_a_run_empties_a_step_folder_it_writes_again(queued, tmp_path):
    """Resumed in place from step 2, with step 4's and 6's manifests gone (checkpoints that never
    completed), a rank file of another layout in step-4 and a step-3 that never completed: step-4 is
    emptied before the actors write into it (it was there when the run started), step-3 removed once a
    later manifest is written; the run ends where the uninterrupted one did."""
    out, _ = queued
    branch = tmp_path / "branch"
    shutil.copytree(out, branch)
    ck = branch / "checkpoints"
    for k in (4, 6):
        (ck / f"step-{k}" / "manifest.json").unlink()
    (ck / "step-4" / "rank-2.pt").write_bytes(b"stale")
    (ck / "step-3").mkdir()
    (ck / "step-3" / "rank-0.pt").write_bytes(b"stale")
    assert main(["--resume", str(ck / "step-2")]) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4", "step-6"]
    assert sorted(p.name for p in (ck / "step-4").iterdir()) == ["manifest.json", "metrics.parquet",
                                                                 "rank-0.pt", "rank-1.pt"]
    assert load_checkpoint(ck / "step-4").step == 4   # (sizes and sha256 checked)
    assert_same_state(torch.load(branch / "model.pt", weights_only=True),
                      torch.load(out / "model.pt", weights_only=True), atol=1e-10)


def test_a_checkpoint_begun_while_the_one_before_is_written_completes_after_it(ray_cluster, want, tmp_path):
    """A checkpoint every step; rank 0's file of step 3 first meets a folder in its place (its write
    fails and is tried again, 0.5 s and then 2 s later, from the same host copy) until the folder is
    removed 1 s after the checkpoint began. The checkpoints after it begin meanwhile (open at once in the
    driver; rank 0's next ``checkpoint_start`` waits for that write, keeping its result), and every
    checkpoint completes, manifests in step order, each holding the steps before it."""
    out = tmp_path / "run"
    lines: list[str] = []
    open_at: dict[int, list[int]] = {}
    begin = loop.checkpoint

    def begun(run, group, step, **kw):
        if step == 3:
            (out / "checkpoints" / "step-3" / "rank-0.pt" / "in-the-way").mkdir(parents=True)
            threading.Timer(1.0, shutil.rmtree, args=(out / "checkpoints" / "step-3" / "rank-0.pt",)).start()
        folder = begin(run, group, step, **kw)
        open_at[step] = [w.step for w in run.checkpoints.open]
        return folder

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "checkpoint", begun)
        train_run(config(out, checkpoint_every=1), log=lines.append)
    assert any(len(steps) >= 2 for steps in open_at.values()), open_at
    assert [x for x in lines if x.startswith("checkpoint ")] == \
        [f"checkpoint {out / 'checkpoints' / f'step-{k}'}" for k in range(1, STEPS + 1)], lines
    assert [p.name for p in list_checkpoints(out)] == [f"step-{k}" for k in range(1, STEPS + 1)]
    ckpt = load_checkpoint(out / "checkpoints" / "step-3")   # (sizes and sha256 checked)
    assert [r["step"] for r in rows(ckpt.files["metrics.parquet"])] == [0, 1, 2]
    assert_same_state(ckpt.payloads()[0]["model"], ckpt.payloads()[1]["model"], atol=0)
    assert_same_state(torch.load(out / "model.pt", weights_only=True), want, atol=1e-10)

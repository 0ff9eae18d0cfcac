"""Checkpoints and resume on a real local Ray cluster: k steps + resume + k steps equals 2k steps
straight, parameter for parameter and momentum for momentum (float64, dp=2); a --dp change under pure
data parallelism; a dp2 x pp2 checkpoint with the recipe on continued under other layouts; and every bad
resume is one clear error that leaves the files as they were."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from support.helpers import assert_same_state
from rayconv.outputs.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, whole_state,
                                        write_checkpoint)
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.run import main

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 8  # 2k with k = 4; checkpoints every 2 steps


class Stop(Exception):
    """Raised from on_step to end a run mid-way, as a crash would."""


def ck_config(out: Path, **kw) -> Config:
    base = dict(model="convnet", data="digits", dp=2, global_batch_size=64, steps=STEPS, lr=0.05,
                precision="fp64", device="cpu", progress=False, eval_every=3, out=str(out),
                checkpoint_every=2, keep_checkpoints=2, loader_workers=0)
    base.update(kw)
    return Config(**base).validate()


def rank_file(ckpt: Path, rank: int) -> dict:
    """Rank ``rank``'s whole state, rebuilt from the rank files the actors wrote (each tensor once)."""
    return load_checkpoint(ckpt).payloads()[rank]


def assert_same_rank_file(got: dict, want: dict) -> None:
    assert_same_state(got["model"], want["model"], atol=0.0)
    go, wo = got["optimizer"], want["optimizer"]
    assert go["param_groups"] == wo["param_groups"]
    assert go["state"].keys() == wo["state"].keys()
    for i in wo["state"]:
        assert torch.equal(go["state"][i]["momentum_buffer"], wo["state"][i]["momentum_buffer"]), i


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(ray_cluster, tmp_path_factory) -> Path:
    """2k steps without interruption."""
    out = tmp_path_factory.mktemp("ck") / "straight"
    train_run(ck_config(out), log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def stopped(ray_cluster, tmp_path_factory) -> Path:
    """The same run, stopped by an error after k steps (and its checkpoint at step k)."""
    out = tmp_path_factory.mktemp("ck") / "stopped"

    def crash(actor_group, step):
        if step == STEPS // 2 - 1:
            raise Stop()

    with pytest.raises(Stop):
        train_run(ck_config(out), log=lambda *_: None, on_step=crash)
    return out


def test_checkpoint_files(straight):
    # --keep-checkpoints 2 pruned step-2 and step-4; the last step is always written.
    assert [p.name for p in list_checkpoints(straight)] == ["step-6", "step-8"]
    ckpt = straight / "checkpoints" / "step-6"
    m = json.loads((ckpt / "manifest.json").read_text())
    assert m["step"] == 6 and m["model"] == "convnet"
    assert {k: m["layout"][k] for k in ("dp", "pp", "fs", "plan")} == {"dp": 2, "pp": 1, "fs": 1,
                                                                       "plan": "none"}
    assert (
        m["data"]["next_step"] == 6
        and m["lr_schedule"]["next_step"] == 6
        and m["lr_schedule"]["total_steps"] == 8
    )
    assert m["config"]["steps"] == STEPS
    assert sorted(f["name"] for f in m["files"]) == ["metrics.parquet", "rank-0.pt", "rank-1.pt"]
    for f in m["files"]:
        assert (ckpt / f["name"]).stat().st_size == f["bytes"] and len(f["sha256"]) == 64
    s = rank_file(ckpt, 1)  # plain tensors and types: loads with weights_only=True
    assert s["role"] == "dp1" and {"torch", "numpy_keys", "python"} <= set(s["rng"])
    assert pq.read_table(ckpt / "metrics.parquet").num_rows >= 6
    assert not list((straight / "checkpoints").glob("*.tmp"))


def test_failed_run_keeps_its_checkpoints(stopped):
    assert [p.name for p in list_checkpoints(stopped)] == ["step-2", "step-4"]
    assert (stopped / "config.json").is_file() and not (stopped / "model.pt").exists()
    # Its progress is readable: metrics.parquet, written at each checkpoint and evaluation.
    rows = pq.read_table(stopped / "metrics.parquet").to_pylist()
    assert [r["step"] for r in rows if r["kind"] == "train"] == [0, 1, 2, 3]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [2]


# (before the other resumes: the stopped run's actors end with it, and the dp2 runs after this one take
# two of its four, kept)
@pytest.mark.slow
def test_resume_with_more_replicas(straight, stopped, tmp_path):
    """Pure data parallelism: a dp=2 checkpoint continues on dp=4 (every replica holds the whole model)."""
    out = tmp_path / "dp4"
    assert main(["--resume", str(stopped), "--dp", "4", "--out", str(out)]) == 0
    assert_same_state(torch.load(out / "model.pt", weights_only=True),
                      torch.load(straight / "model.pt", weights_only=True), atol=1e-10)
    assert json.loads((out / "summary.json").read_text())["layout"]["dp"] == 4


@pytest.mark.slow
def test_resume_equals_straight_run(straight, stopped, tmp_path, capsys):
    """k steps, stop, ``--resume RUN`` for the other k: identical parameters, momentum and metrics."""
    branch = tmp_path / "branch"
    shutil.copytree(stopped, branch)  # keep the stopped run for the other tests
    assert main(["--resume", str(branch)]) == 0  # every setting from the checkpoint; writes into it
    assert (
        f"rayconv: resuming from {branch / 'checkpoints' / 'step-4'} (step 4 of 8)" in capsys.readouterr().out
    )
    torch.testing.assert_close(torch.load(branch / "model.pt", weights_only=True),
                               torch.load(straight / "model.pt", weights_only=True), rtol=0, atol=0)
    for r in range(2):
        assert_same_rank_file(rank_file(branch / "checkpoints" / "step-8", r),
                              rank_file(straight / "checkpoints" / "step-8", r))
    got = [r for r in pq.read_table(branch / "metrics.parquet").to_pylist() if r["kind"] == "train"]
    want = [r for r in pq.read_table(straight / "metrics.parquet").to_pylist() if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    summary = json.loads((branch / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-4")


def run_failing(argv, capsys) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rayconv: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_resume_a_finished_run_is_refused(straight, capsys):
    """Every step done: refused in one line before Ray starts, the run's files as they were."""
    before = tree(straight)
    line = run_failing(["--resume", str(straight), "--dp", "4"], capsys)
    assert f"already at its last step ({STEPS} of {STEPS})" in line and "raise --steps" in line, line
    assert tree(straight) == before


@pytest.mark.slow
@pytest.mark.parametrize("argv, layout", [
    (["--dp", "1", "--pp", "1", "--fs", "2"], (1, 1, 2)),                         # filter split
    (["--dp", "1", "--pp", "1"], (1, 1, 1)),                                      # one actor
], ids=["fs2", "dp1"])  # (interleaved 1F1B and --plan krizhevsky2014 cuts: tests/unit/test_reshard.py)
def test_dp2_pp2_checkpoint_resumes_under_any_layout(dp2_pp2, argv, layout, tmp_path):
    """One checkpoint of a dp2 x pp2 run with the recipe on (step 2 of 4) continues under another
    layout: its rank files joined, each new actor's part cut from the whole state, LARS's momentum
    with its parameter, the moving average with it; the 2 steps left end at the uninterrupted run's
    parameters and moving average."""
    straight_out, want = dp2_pp2
    out = tmp_path / "resumed"
    assert main(["--resume", str(straight_out / "checkpoints" / "step-2"), *argv, "--out", str(out)]) == 0
    assert_same_state(torch.load(out / "model.pt", weights_only=True), want, atol=1e-10)
    assert_same_state(torch.load(out / "model_ema.pt", weights_only=True),
                      torch.load(straight_out / "model_ema.pt", weights_only=True), atol=1e-10)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-2")
    assert tuple(summary["layout"][k] for k in ("dp", "pp", "fs")) == layout


@pytest.mark.slow   # (its fixture: the dp2 x pp2 run)
@pytest.mark.parametrize("argv, words", [
    (["--dp", "1", "--pp", "13"], ["--pp"]),          # more stages than the model's 12 layers
    (["--dp", "1", "--fs", "33"], ["conv1's 32 output channels", "at most 32"]),
])
def test_resume_into_a_layout_that_cannot_hold_the_model_is_one_line(dp2_pp2, argv, words, tmp_path, capsys):
    ckpt = dp2_pp2[0] / "checkpoints" / "step-2"
    before = tree(ckpt)
    line = run_failing(["--resume", str(ckpt), *argv, "--out", str(tmp_path / "x")], capsys)
    assert all(w in line for w in words), line
    assert not (tmp_path / "x").exists() and tree(ckpt) == before


# The recipe whose state a change of layout carries: the moving average (updated every step), LARS
# (torch SGD's momentum under its groups' settings), clipping (below every step's gradient norm) and
# mixup/cutmix (drawn from (seed, step)). Each layout with it equals one device:
# tests/actors/test_recipe_layouts.py, tests/actors/test_mix_layouts.py.
RECIPE = dict(model_ema=True, model_ema_steps=1, model_ema_decay=0.99, opt="lars", lr=1.0,
              lars_trust_coefficient=0.02, clip_grad_norm=0.1, mixup_alpha=0.4, cutmix_alpha=1.0)


@pytest.fixture(scope="module")
def dp2_pp2(ray_cluster, tmp_path_factory) -> tuple[Path, dict]:
    """A dp2 x pp2 run of 4 steps with ``RECIPE`` on (checkpoints at 2 and 4), and its parameters."""
    out = tmp_path_factory.mktemp("ck") / "dp2pp2"
    cfg = ck_config(out, pp=2, num_microbatches=2, steps=4, eval_every=100, **RECIPE)
    train_run(cfg, log=lambda *_: None)
    want = torch.load(out / "model.pt", weights_only=True)
    # the checkpoint read without Ray: the rank files joined into the model's state_dict
    whole = whole_state(out / "checkpoints" / "step-4")
    assert whole["step"] == 4 and whole_state(out)["step"] == 4   # (a run folder: its newest)
    assert_same_state(whole["model"], want, atol=0)
    assert_same_state(whole["ema"]["tensors"], torch.load(out / "model_ema.pt", weights_only=True), atol=0)
    return out, want


def test_resume_another_model_is_refused(stopped, tmp_path, capsys):
    before = tree(stopped)
    line = run_failing(["--resume", str(stopped), "--model", "convnet_bn"], capsys)
    assert "'convnet'" in line and "convnet_bn" in line
    assert tree(stopped) == before


def test_truncated_checkpoint_file_is_named(stopped, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(stopped, bad)
    f = bad / "checkpoints" / "step-4" / "rank-1.pt"
    f.write_bytes(f.read_bytes()[:1000])
    before = tree(bad)
    line = run_failing(["--resume", str(bad)], capsys)
    assert str(f) in line and "truncated" in line
    assert tree(bad) == before


def test_corrupt_checkpoint_file_is_named(stopped, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(stopped / "checkpoints" / "step-2", bad)
    f = bad / "rank-0.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    line = run_failing(["--resume", str(bad), "--out", str(tmp_path / "x")], capsys)
    assert str(f) in line and "sha256" in line
    assert not (tmp_path / "x").exists()


def test_resume_folder_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "nope"
    line = run_failing(["--resume", str(missing)], capsys)
    assert str(missing) in line and "no such folder" in line
    assert not missing.exists()


def test_resume_a_run_without_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    line = run_failing(["--resume", str(run)], capsys)
    assert "no complete checkpoint" in line and "--checkpoint-every" in line


def test_checkpoint_write_is_atomic(tmp_path):
    """A write that fails half-way leaves step-<k>.tmp behind, never a step-<k>: the previous
    checkpoint stays the newest complete one and loads."""
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    write_checkpoint(tmp_path, 2, [buf.getvalue()], {"model": "m", "layout": {}})
    with pytest.raises(TypeError):
        write_checkpoint(tmp_path, 4, [buf.getvalue(), None], {"model": "m", "layout": {}})  # dies mid-write
    assert (tmp_path / "checkpoints" / "step-4.tmp").is_dir()
    assert not (tmp_path / "checkpoints" / "step-4").exists()
    assert latest_checkpoint(tmp_path).name == "step-2"
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 2 and torch.load(io.BytesIO(ckpt.rank_file(0)), weights_only=True)["w"].sum() == 3


@pytest.mark.parametrize("argv, words", [
    (["--checkpoint-every", "-1"], ["--checkpoint-every", ">= 0"]),
    (["--keep-checkpoints", "-2"], ["--keep-checkpoints"]),
    (["--max-failures", "2"], ["--max-failures", "--checkpoint-every"]),
    (["--max-failures", "2", "--checkpoint-every", "5", "--max-wait", "0"], ["--max-wait", "> 0"]),
])
def test_operations_flags_are_validated(argv, words, tmp_path, capsys):
    line = run_failing([*argv, "--out", str(tmp_path / "x")], capsys)
    assert all(w in line for w in words), line
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_interleaved_pipeline_resume_equals_straight_run(ray_cluster, tmp_path):
    """Interleaved 1F1B (2 stages, 2 model chunks each: non-adjacent layers on one actor): each actor's
    rank file holds its chunks' parameters and momentum under the whole model's names; 6 steps + resume + 2
    steps equals 8 steps exactly. The folder resumed is the straight run's cut back to what a run
    stopped after 6 steps leaves (its step-6 checkpoint is written before step 7 runs): no step-8
    checkpoint, no final files, the metrics of the checkpoint (a stopped run's resume:
    ``test_resume_equals_straight_run``)."""
    kw = dict(dp=1, pp=2, virtual_stages=2, num_microbatches=2)
    straight_out, stopped_out = tmp_path / "straight", tmp_path / "stopped"
    train_run(ck_config(straight_out, **kw), log=lambda *_: None)
    shutil.copytree(straight_out, stopped_out)
    shutil.rmtree(stopped_out / "checkpoints" / f"step-{STEPS}")
    for name in ("model.pt", "summary.json"):
        (stopped_out / name).unlink()
    shutil.copy(stopped_out / "checkpoints" / "step-6" / "metrics.parquet", stopped_out / "metrics.parquet")
    m = json.loads((stopped_out / "checkpoints" / "step-6" / "manifest.json").read_text())
    assert len(m["layout"]["stages"]) == 4  # 2 stages x 2 chunks
    assert main(["--resume", str(stopped_out)]) == 0
    torch.testing.assert_close(torch.load(stopped_out / "model.pt", weights_only=True),
                               torch.load(straight_out / "model.pt", weights_only=True), rtol=0, atol=0)
    for r in range(2):
        assert_same_rank_file(rank_file(stopped_out / "checkpoints" / "step-8", r),
                              rank_file(straight_out / "checkpoints" / "step-8", r))

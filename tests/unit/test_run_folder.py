"""A run's folder and header, without Ray: a finished run's --resume refused before Ray starts (and
continued once --steps is raised), a relative --out refused under a Ray job, the header's absolute
output folder and its --evaluate-only wording, and the end line of a run with no timed step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from rayconv.config import Config
from rayconv.driver.finish import done_line
from rayconv.driver.progress import run_line
from rayconv.driver.setup import check_before_ray, check_job_output, check_steps_left, ray_job
from rayconv.errors import CheckpointError, ConfigError
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import load_checkpoint, write_checkpoint
from rayconv.run import main

JOB_ENV = json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"},
                      "metadata": {"job_submission_id": "raysubmit_abc123", "job_name": "raysubmit_abc123"}})


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_run(folder: Path, steps: int = 8) -> Path:
    """A run folder whose last checkpoint is at its last step (``steps`` of ``steps``): the manifest
    of the digits run at dp=2 (its shards stand-ins: nothing here loads them)."""
    cfg = Config(steps=steps, dp=2, device="cpu", progress=False, out=str(folder))
    source, _, plan = check_before_ray(cfg, None)
    manifest = {"model": cfg.model, "num_classes": source.num_classes, "sample_shape": list(source.sample_shape),
                "layout": {"dp": 2, "pp": 1, "fs": 1, "plan": "none", "stages": [list(s) for s in plan.stages]},
                "config": cfg.to_dict()}
    write_checkpoint(folder, steps, [b"shard0", b"shard1"], manifest)
    (folder / "summary.json").write_text('{"steps": 8, "images_per_s": 1000.0}\n')
    return folder


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayconv: error: ") and "Traceback" not in err, err
    return lines[0]


def test_resuming_a_finished_run_is_refused_before_ray(tmp_path, capsys, silent_address):
    address, contacts = silent_address
    run = finished_run(tmp_path / "r1")
    before = tree(run)
    connected = ray.is_initialized()
    assert main(["--resume", str(run), "--dp", "4", "--address", address]) == 2
    line = one_error_line(capsys)
    assert "already at its last step (8 of 8)" in line and "raise --steps" in line, line
    assert not contacts and ray.is_initialized() == connected, "a cluster was contacted before the refusal"
    assert tree(run) == before  # summary.json and the checkpoint as they were


def test_resume_needs_a_step_left():
    ckpt = SimpleNamespace(step=8, path=Path("/r/checkpoints/step-8"), run_dir=Path("/r"))
    with pytest.raises(CheckpointError, match=r"already at its last step \(8 of 8\)"):
        check_steps_left(ckpt, 8)
    with pytest.raises(CheckpointError, match="past this run's last"):
        check_steps_left(ckpt, 6)
    check_steps_left(ckpt, 10)  # --steps raised: it continues


def test_raised_steps_pass_the_checks_before_ray(tmp_path):
    """--steps raised past a finished run's checkpoint: the checks before Ray pass it on (the resume
    itself is ``tests/actors/test_checkpoint.py``'s)."""
    run = finished_run(tmp_path / "r1")
    ckpt = load_checkpoint(run)
    cfg = Config(steps=8, dp=2, device="cpu", progress=False, resume=str(run))
    with pytest.raises(CheckpointError, match="already at its last step"):
        check_before_ray(cfg, ckpt)
    check_before_ray(dataclasses.replace(cfg, steps=12), ckpt)


def test_relative_out_is_refused_under_a_ray_job(tmp_path, capsys, silent_address, monkeypatch):
    address, contacts = silent_address
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", JOB_ENV)
    assert ray_job() == "raysubmit_abc123"
    for argv in (["--out", "runs/r1"], []):  # a relative --out, and the default runs/NAME
        assert main(["--address", address, "--steps", "1", *argv]) == 2
        line = one_error_line(capsys)
        assert "raysubmit_abc123" in line and "give an absolute --out, e.g. --out /shared/runs/NAME" in line, line
        assert str(tmp_path) in line
    assert not contacts and not (tmp_path / "runs").exists()
    check_job_output(str(tmp_path / "r1"))  # an absolute --out is taken


def test_ray_job_is_told_by_its_environment_or_working_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert ray_job() is None
    check_job_output("runs/r1")  # not a Ray job: a relative --out is the user's own folder
    unpacked = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    unpacked.mkdir(parents=True)
    monkeypatch.chdir(unpacked)
    assert ray_job() == ""
    with pytest.raises(ConfigError, match="under a Ray job it would be made in the job's working folder"):
        check_job_output("runs/r1")


def header_setup(**kw) -> SimpleNamespace:
    cfg = Config(device="cpu", **kw)
    return SimpleNamespace(cfg=cfg, mesh=Mesh(2, 1, 1), total_steps=230, out=Path("runs/r1"), run_name="r1-abc123",
                           source=SimpleNamespace(train_size=1438, test_size=359, num_classes=10))


def test_header_names_the_output_folder_in_full(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    line = run_line(header_setup())
    assert f"230 steps -> {tmp_path / 'runs' / 'r1'}; Ray run name r1-abc123" in line, line
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", JOB_ENV)
    assert "; Ray job raysubmit_abc123, Ray run name r1-abc123" in run_line(header_setup())


def test_evaluate_only_header_trains_no_steps():
    line = run_line(header_setup(init="runs/r0/model.pt", evaluate_only=True))
    assert "evaluating --init runs/r0/model.pt only (no training steps)" in line, line
    assert "230" not in line


def test_end_line_of_a_run_without_timed_steps():
    summary = {"final_train_loss": None, "test_accuracy": 0.5, "images_per_s": None, "wall_time_s": 1.0}
    assert done_line(summary, Path("/r")) == "done: train loss n/a, test accuracy 0.5000, n/a images/s, 1.0 s -> /r"

"""A run's folder and header, without Ray: a finished run's --resume refused before Ray starts (and
continued once --steps is raised), and the end line of a run with no timed step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from rayconv.config import Config
from rayconv.driver.finish import done_line
from rayconv.driver.setup import check_before_ray, check_steps_left
from rayconv.errors import CheckpointError
from rayconv.outputs.checkpoint import load_checkpoint, write_checkpoint
from rayconv.run import main

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


def test_end_line_of_a_run_without_timed_steps():
    summary = {"final_train_loss": None, "test_accuracy": 0.5, "images_per_s": None, "wall_time_s": 1.0}
    assert done_line(summary, Path("/r")) == "done: train loss n/a, test accuracy 0.5000, n/a images/s, 1.0 s -> /r"

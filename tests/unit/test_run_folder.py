"""A run's folder and header, without Ray: a finished run's --resume refused before Ray starts (and
continued once --steps is raised), a relative --out refused under a Ray job, the header's absolute
output folder and its --evaluate-only wording, what a stopped run leaves (interrupted: its metrics and
a summary saying so; nothing of value: no folder), and the end line of a run with no timed step."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import ray

from rayconv.config import Config
from rayconv.driver.finish import done_line, recording_stop, writing_into
from rayconv.driver.loop import Run
from rayconv.driver.progress import run_line
from rayconv.driver.prestart import open_output, ray_job
from rayconv.driver.resolve import ResolvedRun, check_before_ray, check_steps_left
from rayconv.errors import CheckpointError, ConfigError
from rayconv.data.source import Sharding
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import check_resumes_newest, load_checkpoint, write_checkpoint
from rayconv.run import main
from rayconv.signals import sigterm_as_interrupt, stopped_by

JOB_ENV = json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"},
                      "metadata": {"job_submission_id": "raysubmit_abc123", "job_name": "raysubmit_abc123"}})


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_run(folder: Path, steps: int = 8) -> Path:
    """A run folder whose last checkpoint is at its last step (``steps`` of ``steps``): the manifest
    of the digits run at dp=2 (stand-ins for its rank files: nothing here loads them)."""
    cfg = Config(steps=steps, dp=2, device="cpu", progress=False, out=str(folder))
    source, _, _, routing = check_before_ray(cfg, None)
    manifest = {
        "model": cfg.model,
        "num_classes": source.num_classes,
        "sample_shape": list(source.sample_shape),
        "layout": {"dp": 2, "pp": 1, "fs": 1, "plan": "none", "stages": [list(s) for s in routing.stages]},
        "config": cfg.to_dict(),
    }
    write_checkpoint(folder, steps, [b"rank0", b"rank1"], manifest)
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


@pytest.mark.parametrize("flags, words", [
    (["--seed", "-1"], ["--seed", "(got -1)"]),
    (["--out", "/proc/rayconv-resumed"], ["--out /proc/rayconv-resumed", "cannot be written"]),
])
def test_a_refused_resume_rewrites_nothing(flags, words, tmp_path, capsys, silent_address):
    """--resume in place (or into an --out that cannot be written) with a setting the config check
    refuses: one line, exit 2, before the cluster is contacted; the run's folder, config.json among it,
    byte for byte as it was."""
    address, contacts = silent_address
    run = finished_run(tmp_path / "r1")
    Config(steps=8, dp=2, device="cpu", progress=False, out=str(run)).to_json(run / "config.json")
    before = tree(run)
    assert main(["--resume", str(run), "--steps", "16", "--address", address, *flags]) == 2
    line = one_error_line(capsys)
    assert all(w in line for w in words), line
    assert not contacts, "a cluster was contacted before the refusal"
    assert tree(run) == before


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


def test_resuming_in_place_from_an_older_checkpoint_is_refused_before_ray(tmp_path, capsys, silent_address):
    """A run folder whose newest checkpoint is step 8, resumed in place from step 4: the run would write
    over steps that step 8 holds; refused in one line naming the newer one, nothing rewritten, no Ray.
    Branching off into another folder is taken."""
    address, contacts = silent_address
    run = finished_run(tmp_path / "r1")
    manifest = json.loads((run / "checkpoints" / "step-8" / "manifest.json").read_text())
    write_checkpoint(run, 4, [b"rank0", b"rank1"], {k: v for k, v in manifest.items() if k != "files"})
    before = tree(run)
    older = run / "checkpoints" / "step-4"
    assert main(["--address", address, "--resume", str(older), "--steps", "12"]) == 2
    line = one_error_line(capsys)
    assert "is older than step-8 of the same run" in line and "--out NEW" in line, line
    assert tree(run) == before and not contacts
    ckpt = load_checkpoint(older)
    check_resumes_newest(ckpt, tmp_path / "branch")   # (another folder: nothing newer there)
    with pytest.raises(CheckpointError, match="older than step-8"):
        check_resumes_newest(ckpt, run)


def test_relative_out_is_refused_under_a_ray_job(tmp_path, capsys, silent_address, monkeypatch):
    address, contacts = silent_address
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", JOB_ENV)
    assert ray_job() == "raysubmit_abc123"
    for argv in (["--out", "runs/r1"], []):  # a relative --out, and the default runs/NAME
        assert main(["--address", address, "--steps", "1", *argv]) == 2
        line = one_error_line(capsys)
        assert (
            "raysubmit_abc123" in line and "give an absolute --out, e.g. --out /shared/runs/NAME" in line
        ), line
        assert str(tmp_path) in line
    assert not contacts and not (tmp_path / "runs").exists()
    out, _ = open_output(Config(out=str(tmp_path / "r1")))  # an absolute --out is taken
    assert out == tmp_path / "r1"


def test_ray_job_is_told_by_its_environment_or_working_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert ray_job() is None
    out, _ = open_output(Config(out="runs/r1"))  # not a Ray job: a relative --out is the user's own folder
    assert out == tmp_path / "runs" / "r1"
    unpacked = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    unpacked.mkdir(parents=True)
    monkeypatch.chdir(unpacked)
    assert ray_job() == ""
    with pytest.raises(ConfigError, match="under a Ray job it would be made in the job's working folder"):
        open_output(Config(out="runs/r1"))


def header_setup(**kw) -> SimpleNamespace:
    cfg = Config(device="cpu", **kw)
    return SimpleNamespace(cfg=cfg, mesh=Mesh(2, 1, 1), total_steps=230, out=Path("runs/r1"),
                           run_name="r1-abc123",
                           source=SimpleNamespace(train_size=1438, test_size=359, num_classes=10),
                           sharding=Sharding(1438, cfg.global_batch_size, cfg.seed))


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
    assert done_line(
        summary, Path("/r")) == "done: train loss n/a, test accuracy 0.5000, n/a images/s, run 1.0 s -> /r"


@pytest.fixture(scope="module")
def setup_of(tmp_path_factory):
    """A real ResolvedRun of the digits run (data, model, routing; no cluster), for a given folder."""
    cfg = Config(steps=100, dp=2, device="cpu", progress=False, global_batch_size=64, loader_workers=0)
    source, _, _, routing = check_before_ray(cfg, None)
    sharding = Sharding(source.train_size, cfg.global_batch_size, cfg.seed)

    def make(out: Path) -> ResolvedRun:
        return ResolvedRun(settings=dataclasses.replace(cfg, out=str(out)), routing=routing, source=source,
                           sharding=sharding, total_steps=100, eval_every=23, out=out,
                           run_name="r-1", resume=None, predicted=None, t_start=time.perf_counter())
    return make


def stop_after(setup: ResolvedRun, steps: int, error, on_disk: bool = False) -> list[str]:
    """Run fit's bookkeeping of ``steps`` steps in ``setup.out`` and stop it with ``error`` (an
    exception, or a signal number sent to this process), inside what fit runs its steps in (SIGTERM
    taken as Ctrl-C, the folder, the stop's record); ``on_disk``: metrics.parquet written before."""
    lines: list[str] = []
    run = Run(setup, log=lines.append)
    with pytest.raises(KeyboardInterrupt if isinstance(error, int) else type(error)):
        with sigterm_as_interrupt(), writing_into(setup.out, lines.append), recording_stop(run):
            setup.saved_config().to_json(setup.out / "config.json")
            for k in range(steps):
                run.metrics.add(kind="train", step=k, epoch=0, loss=2.0 - k / 100, step_ms=10.0)
                run.wall[k] = (64, 0.01)
            if on_disk:
                run.metrics.write(setup.out / "metrics.parquet")
            if isinstance(error, int):
                os.kill(os.getpid(), error)
                time.sleep(5)  # (the handler raises as soon as the signal arrives)
            raise error
    return lines


@pytest.mark.parametrize("error", [KeyboardInterrupt(), signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_run_keeps_its_metrics_and_says_so(setup_of, tmp_path, error):
    """Ctrl-C or SIGTERM after 17 steps, without --checkpoint-every and before the first metrics write:
    the folder stays, with config.json, the 17 steps' metrics and a summary saying it was interrupted."""
    out, handler = tmp_path / "r", signal.getsignal(signal.SIGTERM)
    lines = stop_after(setup_of(out), 17, error)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.parquet", "summary.json",
                                                     "tensorboard"], lines
    assert [r["step"] for r in pq.read_table(out / "metrics.parquet").to_pylist()] == list(range(17))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] == 17 and summary["steps"] == 100
    assert summary["signal"] == stopped_by() == ("SIGTERM" if error == signal.SIGTERM else "SIGINT")
    assert summary["final_train_loss"] == pytest.approx(1.84) and "error" not in summary
    assert not any("removed" in line for line in lines), lines
    assert signal.getsignal(signal.SIGTERM) == handler  # the handler before it is back


def test_stopped_run_with_nothing_to_show_leaves_no_folder(setup_of, tmp_path):
    """Interrupted before its first step (config.json only), or failed before any result was written:
    the folder goes, so that the same command (the same --out) can run again."""
    out = tmp_path / "r"
    lines = stop_after(setup_of(out), 0, KeyboardInterrupt())
    assert not out.exists() and "removed" in lines[-1]
    stop_after(setup_of(out), 5, RuntimeError("collective timed out"))
    assert not out.exists()


def test_failed_run_keeps_the_results_it_wrote(setup_of, tmp_path):
    """A failure after metrics.parquet was written (an evaluation): kept, brought up to the last step,
    and the summary says the run failed and why."""
    out = tmp_path / "r"
    stop_after(setup_of(out), 30, FloatingPointError("loss is nan at step 29: lower --lr (now 0.1)"),
               on_disk=True)
    assert len(pq.read_table(out / "metrics.parquet").to_pylist()) == 30
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_done"] == 30 and summary["error"].startswith(
        "loss is nan")


def test_end_line_gives_the_whole_run_from_its_origin():
    """The run's own seconds (from its checks) and, beside them, the whole wait from the command or call."""
    summary = {"final_train_loss": 0.07, "test_accuracy": 0.97, "images_per_s": 5168.4, "wall_time_s": 8.7,
               "startup": {"origin": "process start", "ended": 29.74}}
    assert done_line(summary, Path("/r")) == ("done: train loss 0.0700, test accuracy 0.9700, 5168 images/s, "
                                              "run 8.7 s, ended 29.7 s after the command -> /r")
    summary["startup"]["origin"] = "fit call"
    assert ", ended 29.7 s after rayconv.fit was called -> " in done_line(summary, Path("/r"))


def test_the_progress_rate_is_over_the_window_without_the_first_step_once_four_more_came():
    """Progress.rate: images over the wall-clock of the last RATE_WINDOW results; the attempt's first
    (compiling) result counts until 4 more came back, then it is left out; never one result's rate."""
    from rayconv.driver.progress import RATE_WINDOW, Progress

    p = Progress(Config(device="cpu", progress=False), total_steps=100, start=0, log=lambda *_: None)
    assert p.rate(16, 4.0, first=True) == pytest.approx(16 / 4.0)
    assert p.rate(16, 0.5, first=False) == pytest.approx(32 / 4.5)   # (not 16 / 0.5, this result's own)
    for _ in range(3):
        rate = p.rate(16, 0.5, first=False)
    assert rate == pytest.approx(64 / 2.0)   # the first left out: four results of 0.5 s
    for _ in range(RATE_WINDOW):
        rate = p.rate(16, 0.25, first=False)
    assert rate == pytest.approx(64.0)   # the window slid past the slower results

"""Searches on the shared 4-CPU cluster (``rayconv.tune``): trials of dp2 in their own placement groups,
ASHA's early stop, a failed trial, an interrupted search resumed; the next trial on the last one's process
and actors; PBT's exploit (a trial continuing another's checkpoint)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from ray import tune as ray_tune

from rayconv import tune

pytestmark = pytest.mark.slow


_FIRED: list[bool] = []  # (the resumed search gets the callback back from Tune's saved state: once only)


class InterruptAfterFirst(ray_tune.Callback):
    """Interrupt the search (SIGUSR1: Tune's Ctrl-C) once the first trial has ended, others unfinished."""

    def on_trial_complete(self, iteration, trials, trial, **info):
        if not _FIRED:
            _FIRED.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)

    on_trial_error = on_trial_complete


@pytest.mark.slow
def test_search_asha_failure_resume(ray_cluster, tmp_path, capfd):
    # lr 1e12 makes the loss overflow at the first steps: that trial fails, the others go on.
    space = {"lr": {"grid": [0.2, 1e12]}, "seed": {"grid": [0, 1]}}
    base = {"dp": 2, "steps": 40, "eval_every": 10, "global_batch_size": 96, "out": str(tmp_path / "s"),
            "metrics": False, "progress": False}
    lines: list[str] = []
    first = tune.search(space, base, scheduler="asha", max_concurrent=2, callbacks=[InterruptAfterFirst()],
                        log=lines.append)
    # Interrupted (Tune's Ctrl-C): said so, with the command that continues it; no best trial named as if
    # the search had ended, no trial it stopped labelled "stopped early" (the scheduler's stop).
    assert first.interrupted and first.best is None, first.rows
    assert lines[-1].startswith("rayconv.tune: interrupted: ") and lines[-1].endswith(
        f"continue with `python -m rayconv.tune --resume {first.search_dir}`"), lines
    assert not any(x.startswith("best:") for x in lines), lines
    assert lines[0].startswith("rayconv.tune: Ray: ") and " cluster " in lines[0], lines   # (which cluster)
    # (trials not yet made when the search stopped are no rows yet)
    assert len(first.rows) < 4 or any(r["status"] == "not run" or r["status"].startswith("interrupted at")
                                      for r in first.rows), first.rows
    assert not any(r["status"].startswith("stopped early") for r in first.rows), first.rows
    found = tune.search({}, resume=str(first.search_dir))
    assert not found.interrupted
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Tuner.restore" not in err, err[-3000:]   # (a failed trial: one line)
    assert "Error file" not in out and "errored after" not in out, out[-3000:]   # (Tune's own console: off)
    rows = {r["trial"]: r for r in found.rows}
    assert len(rows) == 4, found.rows
    failed = [r for r in rows.values() if r["lr"] == 1e12]
    assert all(r["status"].startswith("failed: FloatingPointError: loss is") for r in failed), failed
    good = [r for r in rows.values() if r["lr"] == 0.2]
    assert all(r["status"] == "finished" or r["status"].startswith("stopped early") for r in good), good
    assert found.best is not None and found.best["lr"] == 0.2 and found.best["test_accuracy"] > 0.3
    summary = json.loads((found.search_dir / found.best["trial"] / "summary.json").read_text())
    assert summary["layout"]["dp"] == 2 and summary["steps"] == 40
    saved = json.loads((found.search_dir / "results.json").read_text())
    assert saved["best"]["trial"] == found.best["trial"] and len(saved["trials"]) == 4
    assert (found.search_dir / "results.csv").read_text().count("\n") == 5
    # TensorBoard finds each trial once, in its own run's folder: Tune keeps its JSON and CSV logs but
    # writes no event files of its own, and the process's environment is left as it was.
    tune_dir = found.search_dir / "tune"
    assert list(tune_dir.rglob("result.json")) and list(tune_dir.rglob("progress.csv"))
    assert not list(tune_dir.rglob("events.out.tfevents*"))
    assert "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS" not in os.environ and "RAY_AIR_NEW_OUTPUT" not in os.environ


def test_the_next_trial_runs_on_the_finished_trials_process_and_actors(ray_cluster, tmp_path):
    # Tune hands a finished trial's process and placement group to the next trial of the same resources
    # (reuse_actors); the actors its run kept are renewed for the next run, not started again, and that
    # run equals one of the same settings on new actors.
    from rayconv.driver.job import train_run
    from rayconv.tune.trial import trial_settings

    base = {"dp": 1, "steps": 6, "eval_every": 6, "global_batch_size": 96, "out": str(tmp_path / "r"),
            "metrics": False, "progress": False}
    found = tune.search({"lr": {"grid": [0.2, 0.05]}}, base, scheduler="fifo", max_concurrent=1)
    assert [r["status"] for r in found.rows] == ["finished", "finished"], found.rows
    first, second = (json.loads((found.search_dir / f"trial-{k}" / "summary.json").read_text())
                     for k in (0, 1))
    assert "renewed" not in first["startup"]["actor_process"], first["startup"]
    assert "renewed" in second["startup"]["actor_process"], second["startup"]
    alone = train_run(trial_settings({**base, "device": "cpu", "keep_actors_s": 0}, {"lr": 0.05},
                                     str(tmp_path / "alone")), log=lambda *_: None)
    assert (
        second["final_train_loss"] == alone["final_train_loss"] and second["test_loss"] == alone["test_loss"]
    )


def test_pbt_trial_continues_a_better_trials_checkpoint(ray_cluster, tmp_path):
    # At the first evaluation (synchronous PBT: whichever trial gets there first waits for the other) the
    # trial with the lower test accuracy continues the other's checkpoint, its lr perturbed.
    from rayconv.outputs.metrics import read_rows

    base = {"dp": 1, "steps": 20, "eval_every": 10, "global_batch_size": 96, "out": str(tmp_path / "p"),
            "metrics": False, "progress": False}
    found = tune.search({"lr": {"grid": [0.2, 1e-4]}}, base, scheduler="pbt", perturbation_interval=1,
                        synch=True, max_concurrent=2)
    assert [r["status"] for r in found.rows] == ["finished", "finished"], found.rows
    marks = sorted(found.search_dir.glob("trial-*/tune-branch.json"))
    # the run before it kept
    assert len(marks) == 1 and list(found.search_dir.glob("trial-*.stopped-1")), marks
    for path in marks:
        mark, receiver = json.loads(path.read_text()), path.parent
        # (the checkpoint of that evaluation)
        assert mark["folder"] != str(receiver) and mark["step"] == 10, mark
        row = next(r for r in found.rows if r["trial"] == receiver.name)
        # (the settings it went on with)
        assert json.loads((receiver / "config.json").read_text())["lr"] == row["lr"]
        summary = json.loads((receiver / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["steps_done"] == 20
        assert summary["resumed_from"].endswith(f"checkpoints/step-{mark['step']}")
        # its rows up to the branch are the donor's; its own run up to there (kept aside) scored no better
        def before(folder):
            rows = read_rows((folder / "metrics.parquet").read_bytes())
            return [(r["kind"], r["step"], r["loss"], r["test_accuracy"]) for r in rows
                    if r["step"] < mark["step"]]
        donor = found.search_dir / mark["folder"].rsplit("/", 1)[-1]
        assert before(receiver) == before(donor) and before(donor)
        own = before(receiver.with_name(f"{receiver.name}.stopped-1"))   # its own run up to there
        assert own != before(donor) and own[-1][0] == "eval" and own[-1][3] <= before(donor)[-1][3]
        log = (found.search_dir / "logs" / f"{receiver.name}.log").read_text()
        assert f"continues {donor.name}'s checkpoint of step {mark['step']}" in log

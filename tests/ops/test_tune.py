"""One search on the shared 4-CPU cluster: trials of dp2 in their own placement groups, ASHA's early
stop, a failed trial, an interrupted search resumed (``rayconv.tune``)."""

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
def test_search_asha_failure_resume(ray_cluster, tmp_path):
    # lr 1e12 makes the loss overflow at the first steps: that trial fails, the others go on.
    space = {"lr": {"grid": [0.2, 1e12]}, "seed": {"grid": [0, 1]}}
    base = {"dp": 2, "steps": 40, "eval_every": 10, "global_batch_size": 96, "out": str(tmp_path / "s"),
            "metrics": False, "progress": False}
    first = tune.search(space, base, scheduler="asha", max_concurrent=2, callbacks=[InterruptAfterFirst()])
    # (trials not yet made when the search stopped are no rows yet)
    assert len(first.rows) < 4 or any(r["status"] in ("not run", "interrupted") for r in first.rows), first.rows
    found = tune.search({}, resume=str(first.search_dir))
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

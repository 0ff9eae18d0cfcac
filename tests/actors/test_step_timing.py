"""Each metrics row times its own step, also next to evaluations and checkpoints (two steps in flight),
a progress line per step, and input stall and top-5 accuracy are reported."""

from __future__ import annotations

import json
import re
import statistics

import pyarrow.parquet as pq
import pytest

from rayconv.config import Config
from rayconv.driver.job import train_run

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)


@pytest.mark.slow
def test_rows_time_their_own_step_across_evaluation_and_checkpoint_boundaries(ray_cluster, tmp_path):
    # Evaluation every 2 steps and a checkpoint every 3: the driver waits for the actors after the
    # evaluations' steps (the checkpoint of step 3 is queued behind its step), so the driver's wall time
    # between two results is one step's or two steps' or almost none.
    out = tmp_path / "run"
    lines: list[str] = []
    cfg = Config(model="resnet18", data="synthetic", image_size=32, synthetic_samples=128,
                 global_batch_size=16, dp=1, steps=7, eval_every=2, checkpoint_every=3, log_every=1,
                 device="cpu", progress=False, out=str(out)).validate()
    train_run(cfg, log=lines.append)
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(7))
    times = [r["step_ms"] for r in train]
    typical = statistics.median(times)
    assert min(times) > typical / 4, times  # none is another step's leftover
    for r in train:
        assert r["images_per_s"] * r["step_ms"] / 1e3 == pytest.approx(16)
        assert 0 <= r["input_stall_ms"] <= r["step_ms"]
        assert r["input_stall_fraction"] == pytest.approx(r["input_stall_ms"] / r["step_ms"])
    # A progress line per step with its images/s (the window's rate: tests/unit/test_run_folder.py).
    printed = [float(m.group(1)) for m in (re.search(r"loss \S+ lr \S+\s+(\d+) images/s", x) for x in lines)
               if m]
    assert len(printed) == 7 and all(x > 0 for x in printed), lines
    # Top-5 accuracy at every evaluation (1000 classes), at least the top-1 accuracy.
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all(r["test_accuracy"] <= r["test_top5_accuracy"] <= 1 for r in evals)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["test_top5_accuracy"] == evals[-1]["test_top5_accuracy"]
    assert saved["input_stall_s"] == pytest.approx(sum(r["input_stall_ms"] for r in train) / 1e3)
    assert saved["input_stall_fraction"] == pytest.approx(saved["input_stall_s"] * 1e3 / sum(times))

"""The command line: ``rayconv.run.main`` in-process on the test cluster, and the README's main job as a
subprocess exactly as a user types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
import torch
from torch import nn

from rayconv.config import Config
from rayconv.flags import parse_args
from rayconv.run import main

REPO = Path(__file__).resolve().parents[2]


def placement_group_names() -> set[str]:
    """Names of every placement group the connected cluster has seen (removed ones included)."""
    return {pg["name"] for pg in ray.util.placement_group_table().values()}


@pytest.mark.slow
def test_main_job_as_the_readme_says(ray_cluster, tmp_path):
    """``python -m rayconv.run --out DIR`` and nothing else: digits, convnet, a local Ray cluster of its own.

    The fixture's cluster is up meanwhile; the job must not join it (a subprocess ``ray.init()`` only
    finds clusters started with ``ray start``), so its placement group never appears here."""
    out = tmp_path / "main"
    # (a cache folder of its own: the first command on this machine, no model check passed before)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAYCONV_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "rayconv.run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=420)
    assert (
        proc.returncode == 0
    ), f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "convnet" and summary["data"] == "digits"
    assert summary["test_accuracy"] >= 0.95, summary
    assert "rayconv: Ray: started a local cluster at " in proc.stdout, proc.stdout[-3000:]
    # (as README says)
    assert "rayconv: Ray dashboard: http://127.0.0.1:" in proc.stdout, proc.stdout[-3000:]
    assert {"config.json", "metrics.parquet", "summary.json", "model.pt"} <= {p.name for p in out.iterdir()}
    assert f"rayconv/{summary['run_name']}" not in placement_group_names(), "the job joined the test cluster"
    # The start-up record: seconds since the command to each phase, in the order they ended (the first
    # command with these settings: the driver's imports of torch and its checks of the model before Ray,
    # driver.passed); the console line at step 0 names the slowest.
    st = summary["startup"]
    assert st["origin"] == "process start" and st["ray"] == "started"
    phases = list(st["phases"])
    assert {"imports", "data", "ray", "actors_alive", "model_built", "optimizer_built", "data_on_device",
            "actors_set_up", "first_step"} <= set(phases), st
    assert list(st["phases"].values()) == sorted(st["phases"].values()) and st["phases"]["imports"] > 0
    for before, after in (("imports", "data"), ("data", "ray"), ("ray", "actors_alive"),
                          ("actors_alive", "actors_set_up"), ("actors_set_up", "first_step")):
        assert phases.index(before) < phases.index(after), st
    assert st["slowest"]["phase"] in phases and st["slowest"]["s"] > 0
    assert [line for line in proc.stdout.splitlines() if line.startswith("rayconv: step 0 done ")
            and "s after the command; slowest: " in line], proc.stdout[-3000:]


# What rayconv.run printed for a 2-stage pipeline of 1 micro-batch (2 steps, the defaults otherwise):
# the run-files test's --config re-run is one, read by the overlap-note test (which runs one when alone).
_PRINTED: dict[str, str] = {}


def test_main_writes_the_run_files(ray_cluster, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["--steps", "5", "--out", str(out), "--no-progress", "--device", "cpu", "--dp", "2",
               "--val-split", "0.1", "--keep-best", "--target-accuracy", "0.01"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["best", "config.json", "metrics.parquet", "model.pt",
                                                     "summary.json", "tensorboard"]
    # It ran on the test cluster (and the placement group table keeps removed groups, which the
    # subprocess test relies on).
    run_name = json.loads((out / "summary.json").read_text())["run_name"]
    assert run_name.startswith("run-") and f"rayconv/{run_name}" in placement_group_names()

    # config.json: the resolved settings, loadable as JSON and as a Config.
    saved = json.loads((out / "config.json").read_text())
    assert saved["dp"] == 2 and saved["device"] == "cpu" and saved["steps"] == 5 and saved["out"] == str(out)
    assert saved["progress"] is False
    cfg = parse_args(["--config", str(out / "config.json")])
    assert cfg == Config(**{**saved, "out": None})  # a re-run goes to a new folder unless --out says
    assert parse_args(["--config", str(out / "config.json"), "--out", "elsewhere"]).out == "elsewhere"

    # metrics.parquet: one row per step, one evaluation at the end.
    table = pq.read_table(out / "metrics.parquet")
    rows = table.to_pylist()
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert {"step", "epoch", "loss", "lr", "images_per_s", "step_ms", "test_error"} <= set(table.column_names)
    assert [r["step"] for r in train] == [0, 1, 2, 3, 4]
    for r in train:
        assert r["epoch"] == 0
        assert 0 < r["loss"] < 10 and r["lr"] > 0 and r["images_per_s"] > 0 and r["step_ms"] > 0
    assert train[0]["lr"] == pytest.approx(0.05) and train[-1]["lr"] < train[0]["lr"]  # cosine decay
    assert len(evals) >= 1 and evals[-1]["step"] == 4
    assert 0.0 <= evals[-1]["test_error"] <= 1.0

    # --val-split 0.1: 143 of the 1438 train digits, evaluated each once; the test split at the last step.
    val = evals[-1]["val_accuracy"]
    assert abs(val * 143 - round(val * 143)) < 1e-9 and evals[-1]["val_loss"] > 0
    assert "train + 143 validation / 359 test images" in printed
    assert f"step     4 val_loss {evals[-1]['val_loss']:.4f} val_accuracy {val:.4f}" in printed
    assert f"rayconv: val accuracy {val:.4f} reached --target-accuracy 0.01 after step 4" in printed

    # summary.json
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_split"] == 0.1 and summary["val_accuracy"] == val and summary["target_step"] == 4
    assert summary["best_step"] == 4 and summary["best_val_accuracy"] == val   # --keep-best: best/model.pt
    assert json.loads((out / "best" / "best.json").read_text()) == {"step": 4, "val_accuracy": val}
    # TensorBoard's event files, read by its own reader: the rows of metrics.parquet.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == \
        [(r["step"], pytest.approx(r["loss"])) for r in train]
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(4, pytest.approx(val))]
    assert [e.step for e in events.Scalars("test/accuracy")] == [4]
    assert summary["final_train_loss"] == pytest.approx(train[-1]["loss"])
    assert summary["test_accuracy"] == pytest.approx(1.0 - evals[-1]["test_error"])
    assert summary["images_per_s"] > 0 and summary["wall_time_s"] > 0
    assert summary["layout"]["dp"] == 2 and summary["layout"]["world_size"] == 2
    assert summary["steps"] == 5
    # In a process already connected: the connection is reused; the clock runs from main's call.
    assert summary["startup"]["ray"] == "reused" and summary["startup"]["origin"] == "main call"
    # (the console agrees)
    assert "rayconv: Ray: reusing the local cluster this process started at " in printed
    assert list(summary["startup"]["phases"])[-1] == "first_step"  # (CPU: no CUDA graph captured)

    # model.pt: a plain state_dict that the model class alone loads, strictly.
    state = torch.load(out / "model.pt", weights_only=True)
    best = torch.load(out / "best" / "model.pt", weights_only=True)   # (the one evaluation: the last step's)
    assert best.keys() == state.keys() and all(torch.equal(best[k], state[k]) for k in state)
    from rayconv.models import ConvNet

    model = ConvNet(1, 10)
    model.load_state_dict(state, strict=True)
    # It is the trained model: its test accuracy is the reported one (up to a near-tie flipping).
    from rayconv.data.digits import load_digits

    test = load_digits().sets["test"].tensors
    with torch.no_grad():
        logits = model.eval()(test[0])
    acc = (logits.argmax(1) == test[1]).double().mean().item()
    assert abs(acc - summary["test_accuracy"]) <= 1.5 / len(test[1])
    loss = nn.functional.cross_entropy(logits, test[1]).item()
    assert loss == pytest.approx(summary["test_loss"], rel=1e-4)

    # config.json goes back in through --config (flags for a new folder, fewer steps and another layout
    # win) and runs.
    out2 = tmp_path / "again"
    capsys.readouterr()
    assert main(["--config", str(out / "config.json"), "--out", str(out2), "--steps", "2", "--dp", "1",
                 "--pp", "2"]) == 0
    _PRINTED["pp2"] = capsys.readouterr().out
    again = json.loads((out2 / "config.json").read_text())
    assert again == {**saved, "out": str(out2), "steps": 2, "dp": 1, "pp": 2}


def test_a_pipeline_with_fewer_micro_batches_than_stages_says_how_to_overlap(ray_cluster, tmp_path, capsys):
    if "pp2" not in _PRINTED:
        assert main(["--steps", "2", "--pp", "2", "--no-progress", "--device", "cpu", "--out",
                     str(tmp_path / "m1")]) == 0
        _PRINTED["pp2"] = capsys.readouterr().out
    printed = _PRINTED["pp2"]
    assert "schedule 1f1b, 1 micro-batch:" in printed
    assert ("note: with 1 micro-batch for 2 stages the stages mostly take turns (bubble 50% of the step); "
            "--num-microbatches 8 lets them overlap") in printed
    # Enough micro-batches for the stages, or one stage: no note (the same function, without a run).
    from rayconv.driver.progress import overlap_note
    from rayconv.mesh import Mesh
    from rayconv.models import ConvNet
    from rayconv.parallel.routing import make_routing

    for pp, m in ((2, 4), (2, 2), (1, 1)):
        cfg = Config(pp=pp, dp=1, num_microbatches=m, device="cpu").validate()
        mesh = Mesh(dp=1, pp=pp)
        assert overlap_note(cfg, mesh, make_routing(cfg, mesh, ConvNet(1, 10), (1, 8, 8))) is None


@pytest.mark.parametrize("model, size", [("googlenet", 64), ("inception_v3", 80)])
def test_models_built_without_auxiliary_heads_train(ray_cluster, tmp_path, model, size):
    """GoogLeNet and Inception v3 return a tuple with their auxiliary classifiers' logits when training:
    rayconv builds them without those heads, so a step trains and model.pt loads into torchvision's
    builder given aux_logits=False."""
    import torchvision

    out = tmp_path / model
    rc = main(["--model", model, "--data", "synthetic", "--image-size", str(size), "--num-classes", "10",
               "--synthetic-samples", "8", "--global-batch-size", "4", "--steps", "1", "--dp", "1",
               "--device", "cpu", "--no-progress", "--out", str(out)])
    assert rc == 0
    assert json.loads((out / "summary.json").read_text())["final_train_loss"] > 0
    state = torch.load(out / "model.pt", weights_only=True)
    torchvision.models.get_model(model, num_classes=10, aux_logits=False,
                                 init_weights=True).load_state_dict(state)

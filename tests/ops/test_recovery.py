"""Failures on a real local Ray cluster: a killed actor process is recovered from the last checkpoint
(same result as an uninterrupted run); without --max-failures it ends the job naming the actor; a
stuck collective fails after --collective-timeout-s, naming that flag; a start-up past --max-wait
(resources or actors starting) names that one; a Ray error at start is one line; Ctrl-C stops actors
and the placement group, leaves the last checkpoint loadable and the run's metrics and summary
(interrupted) in its folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from support.helpers import wait_until
from rayconv.outputs.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from ray.util.placement_group import placement_group, remove_placement_group

from rayconv.actor.actor import Actor
from rayconv.cluster import group as cluster
from rayconv.cluster.acquire import ActorSpec, acquire
from rayconv.errors import ClusterError
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.mesh import Mesh

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def cfg_for(out: Path, **kw) -> Config:
    base = dict(model="convnet", data="digits", dp=2, global_batch_size=64, steps=STEPS, lr=0.05,
                precision="fp64", device="cpu", progress=False, eval_every=4, out=str(out),
                checkpoint_every=2, loader_workers=0)
    base.update(kw)
    return Config(**base).validate()


def kill_once(at_step: int, rank: int, sig=signal.SIGKILL):
    """on_step hook: send ``sig`` to actor ``rank``'s process after step ``at_step`` (first time only)."""
    done = []

    def hook(actor_group, step):
        if step == at_step and not done:
            done.append(actor_group.info[rank]["pid"])
            os.kill(actor_group.info[rank]["pid"], sig)
    hook.killed = done
    return hook


_STRAIGHT: dict[str, Path] = {}


def straight_run(tmp_path: Path) -> Path:
    """The uninterrupted run of ``cfg_for`` (dp=2, 8 steps) into ``tmp_path/straight``, which must finish
    all its steps; its folder is kept for the module (one run serves test_ctrl_c_stops_cleanly and the
    recovery test, which runs it itself when run alone)."""
    out = tmp_path / "straight"
    assert train_run(cfg_for(out), log=lambda *_: None)["steps"] == STEPS
    _STRAIGHT["out"] = out
    return out


@pytest.mark.slow
def test_ctrl_c_stops_cleanly(ray_cluster, tmp_path):
    out = tmp_path / "interrupted"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rayconv.run",
            "--address",
            ray.get_runtime_context().gcs_address,
            "--steps",
            "100000",
            "--checkpoint-every",
            "2",
            "--dp",
            "2",
            "--device",
            "cpu",
            "--global-batch-size",
            "32",
            "--no-progress",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # (SIGINT as a terminal's Ctrl-C delivers it: a suite started in the background, `cmd &` in a
        # script, hands its children SIGINT ignored, and Python then raises no KeyboardInterrupt)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_until(proc, lambda: latest_checkpoint(out) is not None and load_checkpoint(out).step >= 4,
                   "no checkpoint", poll_s=0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err
    # The placement group was removed and the actors are gone.
    pgs = [pg for pg in ray.util.placement_group_table().values()
           if pg["name"].startswith(f"rayconv/{out.name}-")]
    assert pgs and all(pg["state"] == "REMOVED" for pg in pgs), pgs
    for role in ("dp0", "dp1"):
        with pytest.raises(ValueError):
            ray.get_actor(f"{pgs[0]['name']}/{role}", namespace="rayconv")
    # The newest checkpoint is complete and loads (sizes and sha256 verified, rank files weights_only).
    assert not list((out / "checkpoints").glob("*.tmp"))
    ckpt = load_checkpoint(out)
    import io
    assert torch.load(io.BytesIO(ckpt.rank_file(0)), weights_only=True)["model"]
    # What the run wrote stays: its settings, every step's metrics, a summary saying it was interrupted.
    import json
    import pyarrow.parquet as pq
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and ckpt.step <= summary["steps_done"] < 100000, summary
    steps = [r["step"] for r in pq.read_table(out / "metrics.parquet").to_pylist() if r["kind"] == "train"]
    assert steps == list(range(summary["steps_done"]))
    assert (out / "config.json").is_file() and not (out / "model.pt").exists()
    # The resources are free: a new run of the same size starts and finishes (the recovery test's
    # uninterrupted run).
    straight_run(tmp_path)


@pytest.mark.slow
def test_killed_actor_is_recovered_from_the_last_checkpoint(ray_cluster, tmp_path):
    """Two losses: rank 1 after step 4 (the last checkpoint step-4: steps 4 and on redone), and rank 0
    after the last step, once its checkpoint is written (the final export finds it dead: the new
    actors load step-8 and export)."""
    straight = _STRAIGHT.get("out") or straight_run(tmp_path)

    out = tmp_path / "recovered"
    lines: list[str] = []
    mid, last = kill_once(at_step=4, rank=1), kill_once(at_step=STEPS - 1, rank=0)

    def hook(actor_group, step):
        mid(actor_group, step)
        last(actor_group, step)
    summary = train_run(cfg_for(out, max_failures=2, max_wait=60), log=lines.append, on_step=hook)
    assert mid.killed and last.killed, "an actor was never killed"
    assert summary["failures_recovered"] == 2
    text = "\n".join(lines)
    assert "dp1" in text and "recovering (1 of --max-failures 2)" in text and "step-4" in text
    assert "recovering (2 of --max-failures 2)" in text and f"step-{STEPS}" in text
    torch.testing.assert_close(torch.load(out / "model.pt", weights_only=True),
                               torch.load(straight / "model.pt", weights_only=True), rtol=0, atol=0)
    import pyarrow.parquet as pq
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    # replayed steps counted once
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(STEPS))
    assert (
        summary["test_accuracy"] == [r for r in rows if r["kind"] == "eval"][-1]["test_accuracy"] is not None
    )


@pytest.mark.slow
def test_killed_actor_without_recovery_ends_the_job(ray_cluster, tmp_path):
    out = tmp_path / "dies"
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        train_run(cfg_for(out, collective_timeout_s=30), log=lambda *_: None,
                  on_step=kill_once(at_step=2, rank=1))
    assert time.monotonic() - t0 < 60
    assert "dp1 (rank 1)" in str(e.value) and "lost" in str(e.value) and "train_step" in str(e.value)
    # The folder stays, with its checkpoints (never deleted), and the newest one loads.
    assert [p.name for p in list_checkpoints(out)] == ["step-2"]
    assert load_checkpoint(out).step == 2


@pytest.mark.slow
def test_stuck_collective_fails_after_the_collective_timeout(ray_cluster, tmp_path):
    """An actor that stops (SIGSTOP) leaves its peer waiting in the gradient all-reduce: the peer's
    collective times out after --collective-timeout-s and the job fails naming an actor, no hang."""
    out = tmp_path / "stuck"
    hook = kill_once(at_step=1, rank=1, sig=signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        train_run(cfg_for(out, collective_timeout_s=5, checkpoint_every=0), log=lambda *_: None, on_step=hook)
    elapsed = time.monotonic() - t0
    try:
        os.kill(hook.killed[0], signal.SIGCONT)
    except ProcessLookupError:
        pass
    assert elapsed < 45, elapsed
    assert "train_step" in str(e.value) and ("dp0" in str(e.value) or "dp1" in str(e.value))
    assert "waited past --collective-timeout-s" in str(e.value)
    assert not out.exists()  # no checkpoint: nothing left behind


def test_start_without_resources_names_max_wait(ray_cluster, tmp_path):
    """The cluster's CPUs are held by someone else: the start gives up after --max-wait, saying so."""
    held = placement_group([{"CPU": 3}])
    ray.get(held.ready(), timeout=60)
    try:
        with pytest.raises(ClusterError) as e:
            train_run(cfg_for(tmp_path / "busy", max_wait=1), log=lambda *_: None)
    finally:
        remove_placement_group(held)
    msg = str(e.value)
    assert (
        "could not reserve 2 x {'CPU': 1} within 1 s (--max-wait)" in msg and "raise --max-wait" in msg
    ), msg
    assert "stuck" not in msg and "\n" not in msg


def test_slow_actor_start_names_max_wait(ray_cluster, tmp_path):
    """Actors still starting (a new process importing torch) when --max-wait runs out: said so, not
    blamed on a stuck actor or collective."""
    spec = ActorSpec(Actor, cfg_for(tmp_path / "slow"), Mesh(2, 1, 1), "slow-start")
    pg = cluster.reserve(spec.bundle, 2, "slow-start", timeout_s=60)  # (the resources are there)
    with pytest.raises(ClusterError) as e:
        cluster.create_actors(Actor, spec.cfg.to_dict(), spec.roles, "slow-start", pg, timeout_s=0.3,
                              bundle=spec.bundle, env=spec.env, key=spec.key(), limit_s=20)
    msg = str(e.value)
    assert (
        msg.startswith("the 2 actors did not start within 20 s (--max-wait;") and "raise --max-wait" in msg
    ), msg
    assert "stuck" not in msg
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


def test_ray_error_at_start_is_one_line(ray_cluster, tmp_path):
    """Ray refusing the start (here: the placement group's name is taken) is a one-line ClusterError."""
    taken = placement_group([{"CPU": 1}], name="rayconv/taken-run")
    try:
        with pytest.raises(ClusterError) as e:
            acquire(ActorSpec(Actor, cfg_for(tmp_path / "x"), Mesh(1, 1, 1), "taken-run", timeout_s=30))
    finally:
        remove_placement_group(taken)
    msg = str(e.value)
    assert (
        msg.startswith("Ray refused the placement group of run taken-run:") and "already exists" in msg
    ), msg
    assert "\n" not in msg

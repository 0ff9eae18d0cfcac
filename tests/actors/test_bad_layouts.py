"""Layouts that cannot work are refused with a clear error before any actor starts (exit 2, no output)."""

from __future__ import annotations

import pytest
from rayconv.run import main

CASES = {
    "mesh-larger-than-cluster": (["--dp", "3", "--fs", "2"], "--dp 2 --fs 2"),
    "pp-on-uncuttable-model": (
        ["--dp", "1", "--pp", "2", "--model", "convnext_tiny", "--data", "synthetic", "--image-size", "32"],
        "--pp 1",
    ),
    "microbatches-not-dividing": (
        ["--dp", "1", "--pp", "2", "--num-microbatches", "5", "--global-batch-size", "64"],
        "--num-microbatches",
    ),
    "fs-more-than-channels": (
        ["--dp", "1", "--fs", "4", "--model", "convnet", "--num-classes", "3", "--data", "synthetic",
         "--image-size", "32"],
        "--fs",
    ),
    "fs-on-unsplittable-model": (
        ["--dp", "1", "--fs", "2", "--model", "resnet18", "--data", "synthetic", "--image-size", "32"],
        "--fs 1",
    ),
    "bad-stage-cut": (["--dp", "1", "--pp", "2", "--stages", "0"], "--stages"),
    "image-too-small-for-model": (
        ["--dp", "1", "--model", "alexnet", "--data", "synthetic", "--image-size", "32"],
        "--image-size",
    ),
    "plan-with-pp": (["--dp", "2", "--pp", "2", "--plan", "krizhevsky2014"], "--plan"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_layout_refused_before_actors(ray_cluster, tmp_path, capsys, name):
    args, must_name = CASES[name]
    out = tmp_path / "out"
    rc = main(args + ["--steps", "2", "--out", str(out), "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("rayconv: error:") and must_name in err[0], err
    assert not out.exists()
    # Refused by the driver's plan, not by an actor that started and failed ("actor ... failed in build").
    assert "failed in" not in err[0] and "(rank" not in err[0], err


def test_too_small_external_cluster_waits_then_fails(ray_cluster, tmp_path, capsys):
    # A cluster named by --address can grow: rayconv says at once which cluster it asked, what it has and
    # what is missing, waits --max-wait seconds, then fails naming a layout that fits and a larger cluster.
    import time

    import ray

    address = ray.get_runtime_context().gcs_address
    t0 = time.monotonic()
    rc = main(["--dp", "3", "--fs", "2", "--steps", "1", "--max-wait", "3", "--address", address,
               "--device", "cpu", "--out", str(tmp_path / "o"), "--no-progress"])
    waited = time.monotonic() - t0
    captured = capsys.readouterr()
    assert rc == 2 and not (tmp_path / "o").exists()
    [wait_line] = [x for x in captured.out.splitlines() if "waiting up to 3 s (--max-wait)" in x]
    # (the cluster is the test process's own)
    assert f"cluster this process started at {address} (4 CPUs, 0 GPUs;" in wait_line, wait_line
    assert "needs 6 CPU slots (1 CPU each), 2 more than it has" in wait_line, wait_line
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "after waiting 3 s" in err[0] and address in err[0], err
    assert "(e.g. --dp 2 --fs 2)" in err[0] and "`ray start --head --num-cpus 6`" in err[0], err
    assert waited >= 3


@pytest.mark.slow
def test_the_wait_is_said_at_once_into_a_pipe(ray_cluster, tmp_path):
    # The command's console lines reach a pipe or a log file as they are printed, not when it exits.
    import os
    import select
    import subprocess
    import sys
    import time

    import ray

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-m", "rayconv.run", "--dp", "3", "--fs", "2",
                             "--max-wait", "300", "--address", address, "--device", "cpu",
                             "--out", str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:   # (within 120 s, well before the run gives up: Python's block buffer would hold it till then)
        ready = select.select([proc.stdout], [], [], 120)[0]
        line = proc.stdout.readline() if ready else ""
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert "waiting up to 300 s (--max-wait)" in line, line

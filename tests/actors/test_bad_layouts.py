"""Layouts that cannot work are refused with a clear error before any actor starts (exit 2, no output)."""

from __future__ import annotations

import pytest
from rayconv.run import main

CASES = {
    "mesh-larger-than-cluster": (["--dp", "3", "--fs", "2"], "--dp/--pp/--fs"),
    "pp-on-uncuttable-model": (["--dp", "1", "--pp", "2", "--model", "convnext_tiny", "--data", "synthetic",
                                "--image-size", "32"], "--pp 1"),
    "microbatches-not-dividing": (["--dp", "1", "--pp", "2", "--num-microbatches", "5",
                                   "--global-batch-size", "64"], "--num-microbatches"),
    "fs-more-than-channels": (["--dp", "1", "--fs", "4", "--model", "convnet", "--num-classes", "3",
                               "--data", "synthetic", "--image-size", "32"], "--fs"),
    "fs-on-unsplittable-model": (["--dp", "1", "--fs", "2", "--model", "resnet18", "--data", "synthetic",
                                  "--image-size", "32"], "--fs 1"),
    "bad-stage-cut": (["--dp", "1", "--pp", "2", "--stages", "0"], "--stages"),
    "image-too-small-for-model": (["--dp", "1", "--model", "alexnet", "--data", "synthetic", "--image-size", "32"],
                                  "--image-size"),
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
    # A cluster named by --address can grow: rayconv waits --max-wait seconds, saying so, then fails.
    import time

    import ray

    address = ray.get_runtime_context().gcs_address
    t0 = time.monotonic()
    rc = main(["--dp", "6", "--steps", "1", "--max-wait", "3", "--address", address, "--device", "cpu",
               "--out", str(tmp_path / "o"), "--no-progress"])
    waited = time.monotonic() - t0
    captured = capsys.readouterr()
    assert rc == 2 and not (tmp_path / "o").exists()
    assert "waiting up to 3 s (--max-wait)" in captured.out
    assert "after waiting 3 s" in captured.err and "--dp/--pp/--fs" in captured.err
    assert waited >= 3

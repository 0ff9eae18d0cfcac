"""Mistakes a user can make: each gives one clear error line naming what to change, a non-zero exit,
no hang, and leaves no output behind (a folder that already existed is left as it was)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from PIL import Image

from rayconv.cluster import connect
from rayconv.config import Config, ConfigError
from rayconv.run import main

# Small and fast on the test cluster; each case adds the flag it gets wrong.
BASE = ["--steps", "2", "--device", "cpu", "--dp", "2", "--global-batch-size", "32", "--no-progress",
        "--loader-workers", "0"]


@pytest.fixture(autouse=True)
def no_hang():
    """Fail (instead of hanging CI) if one case takes more than 3 minutes."""
    def on_alarm(signum, frame):
        raise TimeoutError("rayconv.run.main did not return within 180 s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(180)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def run_failing(argv: list[str], capsys, code: int | None = 2) -> str:
    """Run main, check it fails (with ``code`` when given), return its one ``rayconv: error:`` line."""
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0, "expected a failure"
    if code is not None:
        assert rc == code, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rayconv: error:")]
    assert len(lines) == 1, err
    return lines[0]


def write_images(folder: Path, n: int, seed: int = 0, suffix: str = ".png") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)).save(folder / f"img{i}{suffix}")


def image_tree(root: Path, classes=("a", "b"), train=3, val=1) -> Path:
    for i, c in enumerate(classes):
        write_images(root / "train" / c, train, seed=2 * i)
        write_images(root / "val" / c, val, seed=2 * i + 1)
    return root


# ---------------------------------------------------------------------- caught before Ray is needed
def test_unknown_data_is_an_argparse_error(tmp_path, capsys):
    out = tmp_path / "x"
    with pytest.raises(SystemExit) as e:
        main([*BASE, "--data", "mnist", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--data" in err and "mnist" in err and "imagefolder" in err  # names the flag and the choices
    assert len(err.strip().splitlines()) == 1, err  # one line, not argparse's whole usage block
    assert not out.exists()


def test_imagefolder_without_data_dir(tmp_path, capsys):
    out = tmp_path / "x"
    line = run_failing([*BASE, "--data", "imagefolder", "--out", str(out)], capsys)
    assert "--data-dir" in line
    assert not out.exists()


# ---------------------------------------------------------------------- on the test cluster
def _new_groups(before: set, out: Path) -> list[dict]:
    """The placement groups made since ``before`` (ids) for a run whose folder is ``out``."""
    return [pg for k, pg in ray.util.placement_group_table().items()
            if k not in before and pg["name"].startswith(f"rayconv/{out.name}-")]


def _checked_before(argv: list[str]) -> None:
    """The model's checks of ``argv``'s settings passed on this machine (``driver.passed``): a run with
    them starts its actors first and checks meanwhile."""
    from rayconv.driver.resolve import check_before_ray
    from rayconv.run import parse_command_line

    check_before_ray(parse_command_line(argv), None)


def test_unknown_model(ray_cluster, tmp_path, capsys, monkeypatch):
    """Refused by the model's check before Ray is asked for anything (this machine's listing of
    torchvision's models, which would refuse it sooner, left out): one line, no placement group."""
    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "no-listing"))
    out = tmp_path / "unknown-model"
    before = set(ray.util.placement_group_table())
    line = run_failing([*BASE, "--model", "resnet1000", "--keep-actors-s", "0", "--out", str(out)], capsys)
    assert "--model" in line and "resnet1000" in line and "resnet18" in line  # suggests close names
    assert not out.exists() and not _new_groups(before, out)


def test_a_refusal_while_the_actors_start_leaves_nothing(ray_cluster, tmp_path, capsys, monkeypatch):
    """Settings whose model checks passed before start their actors first (``driver.early``); a check
    made meanwhile that refuses the run (a warm-up longer than the run) gives one line, and with
    ``--keep-actors-s 0`` nothing is left on the cluster: their placement group reserved and removed,
    their actors gone, every CPU free again."""
    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "cache"))
    _checked_before(BASE)
    out = tmp_path / "long-warm-up"
    before = set(ray.util.placement_group_table())
    line = run_failing([*BASE, "--lr-warmup-epochs", "50", "--keep-actors-s", "0", "--out", str(out)], capsys)
    assert "--lr-warmup-epochs 50" in line and "longer than the run" in line, line
    assert not out.exists()
    pgs = _new_groups(before, out)
    assert pgs, "the actors did not start while the run was checked"
    assert all(pg["state"] == "REMOVED" for pg in pgs), pgs
    deadline = time.monotonic() + 10   # (ray.kill ends the processes asynchronously)
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4
    for role in ("dp0", "dp1"):
        with pytest.raises(ValueError):
            ray.get_actor(f"{pgs[0]['name']}/{role}", namespace="rayconv")


def test_the_corrected_run_takes_the_refused_runs_actors(ray_cluster, tmp_path, capsys, monkeypatch):
    """A run refused while its actors start keeps them, unused, as a finished run's are kept
    (``--keep-actors-s``): the corrected run of the same process trains on those processes, and once
    it ends and its actors are released every CPU is free again."""
    from rayconv.api import release_actors
    from rayconv.cluster import pool

    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "cache"))
    _checked_before(BASE)
    run_failing([*BASE, "--lr-warmup-epochs", "50", "--out", str(tmp_path / "refused")], capsys)
    kept = pool.kept_group()
    assert kept is not None and len(kept.actors) == 2, "the refused run's actors were not kept"
    pids = ray.get([a.whereami.remote() for a in kept.actors])
    assert main([*BASE, "--out", str(tmp_path / "corrected")]) == 0
    assert "2 actors kept from this process's previous run, reused" in capsys.readouterr().out
    # (the corrected run, ended, keeps its actors in turn: the same processes)
    assert [i["pid"] for i in ray.get([a.whereami.remote() for a in pool.kept_group().actors])] == \
        [p["pid"] for p in pids]
    release_actors()
    deadline = time.monotonic() + 10   # (ray.kill ends the processes asynchronously)
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4


def test_unknown_model_leaves_an_existing_empty_folder_empty(ray_cluster, tmp_path, capsys):
    out = tmp_path / "x"
    out.mkdir()
    run_failing([*BASE, "--model", "nosuchnet", "--out", str(out)], capsys)
    assert out.is_dir() and list(out.iterdir()) == []


def test_data_dir_does_not_exist(ray_cluster, tmp_path, capsys):
    out = tmp_path / "x"
    missing = tmp_path / "no-such-data"
    line = run_failing([*BASE, "--data", "imagefolder", "--data-dir", str(missing), "--image-size", "32",
                        "--out", str(out)], capsys)
    assert str(missing) in line and "--data-dir" in line and "does not exist" in line
    assert not out.exists()


def test_class_folders_without_images(ray_cluster, tmp_path, capsys):
    root = tmp_path / "data"
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            (root / split / c / "notes.txt").write_text("not an image")
    out = tmp_path / "x"
    line = run_failing([*BASE, "--data", "imagefolder", "--data-dir", str(root), "--image-size", "32",
                        "--out", str(out)], capsys)
    assert str(root / "train") in line and "no image files" in line
    assert not out.exists()


def test_one_class_folder_without_images(ray_cluster, tmp_path, capsys):
    root = image_tree(tmp_path / "data")
    (root / "train" / "empty").mkdir()
    (root / "val" / "empty").mkdir()
    out = tmp_path / "x"
    line = run_failing([*BASE, "--data", "imagefolder", "--data-dir", str(root), "--image-size", "32",
                        "--out", str(out)], capsys)
    assert "empty" in line and str(root / "train") in line
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("workers, out_exists, on_device",
                         [(0, False, "auto"), (2, True, "off"), (2, False, "on")])
def test_corrupt_image_names_the_file(ray_cluster, tmp_path, capsys, workers, out_exists, on_device):
    """Only an actor decoding the file finds it: the run stops with the file's path (the loader's batch
    decode in train_step, or the one-time decode of data held on the device in the actors' setup)."""
    root = image_tree(tmp_path / "data", train=4)
    bad = root / "train" / "b" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    out = tmp_path / "x"
    if out_exists:
        out.mkdir()
    # 9 train files and a global batch of 32: step 1 decodes all of them, over both replicas.
    # (bad input, exit 2, though an actor met it)
    line = run_failing(["--steps", "2", "--device", "cpu", "--dp", "2", "--global-batch-size", "32",
                        "--no-progress", "--data", "imagefolder", "--data-dir", str(root),
                        "--image-size", "32", "--loader-workers", str(workers), "--data-on-device", on_device,
                        "--out", str(out)],
                       capsys)
    where = "train_step" if on_device == "off" else "in build"
    assert str(bad) in line and where in line and "remove or replace" in line
    if out_exists:
        assert out.is_dir() and list(out.iterdir()) == []
    else:
        assert not out.exists()


@pytest.mark.slow
def test_a_diverging_loss_exits_2_naming_lr(ray_cluster, tmp_path, capsys):
    """A loss that is not finite: the settings' (the training diverged), one line naming --lr, exit 2."""
    out = tmp_path / "x"
    line = run_failing([*BASE, "--steps", "6", "--lr", "1e30", "--out", str(out)], capsys)
    assert "loss is" in line and "lower --lr (now 1e+30)" in line, line


def test_a_layout_the_model_rules_out_is_refused_before_waiting_for_devices(ray_cluster, tmp_path, capsys,
                                                                           monkeypatch):
    """On a cluster that can grow (RAY_ADDRESS: the run would wait --max-wait for more devices), a layout
    the model alone rules out (--fs above its channels; --pp above its layers, resumed) is refused as
    that at once, never after the wait; nothing written."""
    from rayconv.outputs.checkpoint import write_checkpoint

    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    run = tmp_path / "r1"   # a checkpoint's manifest of a dp=1 digits run (its rank file a stand-in)
    cfg = Config(steps=4, dp=1, device="cpu", progress=False, out=str(run)).validate()
    manifest = {"model": "convnet", "num_classes": 10, "sample_shape": [1, 8, 8], "config": cfg.to_dict(),
                "layout": {"dp": 1, "pp": 1, "fs": 1, "plan": "none"}}
    write_checkpoint(run, 2, [b"rank file"], manifest)
    before = sorted(p.name for p in run.rglob("*"))
    for argv, words in ((["--dp", "1", "--fs", "64", "--out", str(tmp_path / "x")], ["--fs"]),
                        (["--resume", str(run), "--steps", "4", "--dp", "1", "--pp", "20"], ["--pp"])):
        t0 = time.monotonic()
        line = run_failing([*BASE, "--max-wait", "30", *argv], capsys)
        assert time.monotonic() - t0 < 30 and "after waiting" not in line, line
        assert all(w in line for w in words), line
    assert not (tmp_path / "x").exists() and sorted(p.name for p in run.rglob("*")) == before


@pytest.mark.slow
def test_a_failed_resume_in_place_keeps_the_runs_config_json(ray_cluster, tmp_path, capsys):
    """--resume in place whose actors fail in their setup (a user's model that raises there): the run's
    config.json stays the one of the run that trained, byte for byte (written once the actors are set up)."""
    flag = tmp_path / "fail-on-actors"
    model = tmp_path / "fails_on_actors_net.py"   # (a name no other test imports in this process)
    model.write_text(f"""import pathlib

import ray
from torch import nn


def Net(num_classes: int = 10, in_channels: int = 1):
    if pathlib.Path({str(flag)!r}).exists() and ray.get_runtime_context().get_actor_id() is not None:
        raise RuntimeError("this model fails on the actors")
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 64, num_classes))
""")
    run = tmp_path / "r1"
    flags = ["--device", "cpu", "--dp", "1", "--global-batch-size", "32", "--no-progress",
             "--loader-workers", "0", "--model", f"{model}:Net"]
    assert main([*flags, "--steps", "2", "--checkpoint-every", "2", "--out", str(run)]) == 0
    before = (run / "config.json").read_bytes()
    flag.touch()
    line = run_failing(["--resume", str(run), "--steps", "4", "--no-progress"], capsys)   # (the model's: 2)
    assert "this model fails on the actors" in line, line
    assert (run / "config.json").read_bytes() == before


def test_dp_larger_than_the_cluster(ray_cluster, tmp_path, capsys):
    out = tmp_path / "x"
    line = run_failing(["--steps", "1", "--device", "cpu", "--dp", "8", "--no-progress", "--out", str(out)],
                       capsys)
    assert "--dp" in line and "8" in line and "4" in line  # wanted and available
    assert not out.exists()


def test_global_batch_smaller_than_dp(ray_cluster, tmp_path, capsys):
    out = tmp_path / "x"
    line = run_failing(["--steps", "1", "--device", "cpu", "--dp", "4", "--global-batch-size", "3",
                        "--no-progress", "--out", str(out)], capsys)
    assert "--global-batch-size" in line and "--dp" in line
    assert not out.exists()


def test_cuda_without_gpus(ray_cluster, tmp_path, capsys):
    if ray.cluster_resources().get("GPU", 0) > 0:
        pytest.skip("the test cluster has GPUs")
    out = tmp_path / "x"
    line = run_failing(["--steps", "1", "--device", "cuda", "--no-progress", "--out", str(out)], capsys)
    assert "--device" in line and "cpu" in line
    assert not out.exists()


def test_cuda_graphs_on_cpu(ray_cluster, tmp_path, capsys):
    out = tmp_path / "x"
    line = run_failing(BASE + ["--cuda-graphs", "on", "--out", str(out)], capsys)
    assert "--cuda-graphs on needs GPUs" in line and "cpu" in line.lower()
    assert not out.exists()
    with pytest.raises(ConfigError, match="--cuda-graphs on needs GPUs"):  # refused before Ray starts
        Config(cuda_graphs="on", device="cpu").validate()


def test_out_folder_with_files_is_not_overwritten(ray_cluster, tmp_path, capsys):
    out = tmp_path / "x"
    out.mkdir()
    (out / "summary.json").write_text("precious")
    (out / "notes.txt").write_text("keep me")
    line = run_failing([*BASE, "--out", str(out)], capsys)
    assert "--out" in line and str(out) in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "summary.json"]
    assert (out / "summary.json").read_text() == "precious"
    assert (out / "notes.txt").read_text() == "keep me"


def test_unreachable_address_fails_fast(tmp_path, capsys):
    import time

    out = tmp_path / "x"
    t0 = time.monotonic()
    rc = main(["--address", "127.0.0.1:9", "--steps", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t0 < 30
    assert "cannot reach a Ray cluster at 127.0.0.1:9" in err and "--address" in err
    assert not out.exists()


def test_address_where_something_else_answers(tmp_path, capfd, silent_address, monkeypatch):
    """A TCP listener on loopback that accepts and says nothing (not a Ray GCS): one line, exit 2,
    none of Ray's own client errors (captured at the file-descriptor level, where Ray's C++ logs go).
    (The handshake's wait lowered from its 5 s: a loopback listener that will answer does so at once.)"""
    monkeypatch.setattr(connect, "PROBE_TIMEOUT_S", 0.5)
    address, held = silent_address
    out = tmp_path / "x"
    capfd.readouterr()
    rc = main(["--address", address, "--steps", "1", "--device", "cpu", "--out", str(out)])
    err = capfd.readouterr().err
    assert rc == 2, err
    assert err.strip().splitlines() == [err.strip()], err
    assert err.startswith(f"rayconv: error: something answers at {address} but not a Ray cluster") \
        and "--address" in err
    assert held, "the listener was never contacted"
    assert not out.exists()

"""What the model alone rules out is refused before Ray is reached: a layout the model's layers or channels
cannot be split into, a model that cannot take the data's images, also under ``--resume`` (one line, exit
2, the cluster's address never contacted, nothing written); a run whose settings passed the model's checks
on this machine before starts its actors first and checks meanwhile (``driver.passed``). --device cuda
for a local cluster on a host without GPUs is refused before Ray starts one."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rayconv.config import Config
from rayconv.driver import passed
from rayconv.driver.resolve import check_before_ray
from rayconv.outputs.checkpoint import write_checkpoint
from rayconv.run import main

REFUSED = [
    (["--dp", "1", "--fs", "64"], "exceeds layer conv1's 32 output channels"),
    (["--dp", "1", "--pp", "20", "--stages", ",".join(str(i) for i in range(1, 20))],
     "cut points must increase strictly within 1..11"),
    (["--pp", "20"], "--pp 20 needs at least 20 cuttable layers"),
    (["--model", "alexnet", "--data", "digits"], "cannot take 8x8 images"),
]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayconv: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("flags, said", REFUSED, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_what_the_model_rules_out_is_refused_before_ray(flags, said, tmp_path, capsys, silent_address, cache):
    address, contacts = silent_address
    out = tmp_path / "run"
    assert main([*flags, "--address", address, "--steps", "2", "--out", str(out)]) == 2
    line = one_error_line(capsys)
    assert said in line, line
    assert not contacts, "the cluster's address was reached before the refusal"
    assert not out.exists()


def test_a_resumed_run_on_a_layout_the_model_cannot_take_is_refused_before_ray(tmp_path, capsys,
                                                                                silent_address, cache):
    address, contacts = silent_address
    run = tmp_path / "r1"
    cfg = Config(steps=4, dp=1, device="cpu", progress=False, out=str(run))
    source, _, _, routing = check_before_ray(cfg, None)
    write_checkpoint(run, 2, [b"rank0"], {
        "model": cfg.model, "num_classes": source.num_classes, "sample_shape": list(source.sample_shape),
        "layout": {"dp": 1, "pp": 1, "fs": 1, "plan": "none", "stages": [list(s) for s in routing.stages]},
        "config": cfg.to_dict()})
    before = tree(run)
    for flags, said in [(["--dp", "1", "--pp", "20"], "--pp 20 needs at least 20 cuttable layers"),
                        (["--fs", "64"], "exceeds layer conv1's 32 output channels")]:
        assert main(["--resume", str(run), *flags, "--address", address]) == 2
        assert said in one_error_line(capsys)
    assert not contacts, "the cluster's address was reached before the refusal"
    assert tree(run) == before   # (config.json neither written nor rewritten)


def test_settings_whose_model_checks_passed_are_remembered_without_what_the_checks_never_read(cache):
    cfg = Config(steps=2, dp=1, device="cpu").validate()
    assert not passed.passed(cfg)
    check_before_ray(cfg, None)
    assert passed.passed(cfg)
    assert passed.passed(dataclasses.replace(cfg, steps=50, lr=0.3, seed=4, out="elsewhere"))
    for other in ({"fs": 2}, {"pp": 2}, {"model": "convnet_bn"}, {"data": "synthetic"}):
        assert not passed.passed(dataclasses.replace(cfg, **other)), other
    assert passed.UNREAD <= {f.name for f in dataclasses.fields(Config)}   # (each a setting's name)


def test_device_cuda_on_a_host_without_gpus_is_refused_before_a_local_cluster_starts(tmp_path):
    """A command that would start its own local cluster (no --address, no RAY_ADDRESS, none running under
    its Ray temp dir) for --device cuda on a host with no GPU (CUDA_VISIBLE_DEVICES empty: none, whatever
    the host has) refuses in one line before Ray starts: nothing written under that temp dir."""
    with tempfile.TemporaryDirectory(prefix="rc-", dir="/tmp") as ray_tmp:   # (short: Ray's socket paths)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=ray_tmp, TMPDIR=ray_tmp, CUDA_VISIBLE_DEVICES="",
                   RAYCONV_CACHE_DIR=str(tmp_path / "cache"))
        out = subprocess.run([sys.executable, "-m", "rayconv.run", "--device", "cuda", "--steps", "2",
                              "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                             timeout=300)
        started = sorted(p.name for p in Path(ray_tmp).iterdir())
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["rayconv: error: --device cuda but the Ray cluster has no "
                                               "GPUs: use --device cpu (or auto)"], out.stderr
    assert started == [], f"Ray started under its temp dir: {started}"


def test_a_host_has_a_gpu_where_its_driver_or_device_files_show_one_and_cuda_may_see_it(tmp_path):
    from rayconv.cluster.host import has_nvidia_gpu

    proc, dev = tmp_path / "proc", tmp_path / "dev"
    (proc / "driver" / "nvidia" / "gpus").mkdir(parents=True)
    dev.mkdir()
    (dev / "nvidiactl").write_text("")

    def has(visible=None):
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        return has_nvidia_gpu(env, str(proc), str(dev))

    assert not has()   # (driver loaded, no GPU listed, no nvidiaN device file)
    (dev / "nvidia0").write_text("")
    assert has() and has("0") and has("GPU-5c1e")
    assert not has("") and not has("-1") and not has("-1,0") and not has("NoDevFiles")
    (dev / "nvidia0").unlink()
    (proc / "driver" / "nvidia" / "gpus" / "0000:01:00.0").mkdir()
    assert has() and not has("")

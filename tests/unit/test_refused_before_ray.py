"""What the model alone rules out is refused before Ray is reached: a layout the model's layers or channels
cannot be split into, a model that cannot take the data's images, also under ``--resume`` (one line, exit
2, the cluster's address never contacted, nothing written); a run whose settings passed the model's checks
on this machine before starts its actors first and checks meanwhile (``driver.passed``)."""

from __future__ import annotations

import dataclasses
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

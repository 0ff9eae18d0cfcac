"""A user's own ResNet-like ConvNet (tests/support/fixtures/resnetish.py: skip connections, batch norm; not
installed) for grey images, built by ``models/greynet.py:build`` (which imports ResNetish from the
module beside it and names no ``in_channels``: the digits reach it as the 1 channel its first
convolution takes), trains under dp=2 as single-device SGD does (float64, to 1e-10), its model.pt
loads into ResNetish, and ``--evaluate-only --init`` of that model.pt reports the run's test accuracy.

The files are copied into a folder the driver then runs in, named by a relative path that the actors
(which run in the folder the test's Ray cluster started from) do not see: they import both from Ray's
``py_modules``. Batch norm under
dp=2 normalises each replica's share by its own statistics, so the reference is
``helpers.reference_microbatch_sgd`` (running statistics from replica 0, as in DDP). The measuring
tasks of ``--balance time`` and of the planner (``cluster.tasks.run_on_device``) get the same module."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from support.helpers import assert_same_state, reference_microbatch_sgd, sgd_config
from rayconv.driver.job import train_run
from rayconv.user_model import resolve
from rayconv.planner.measure import Measurements
from rayconv.planner.search import plan_config
from rayconv.run import main

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "resnetish.py"
MODEL = "models/greynet.py:build"
GREYNET = ("from resnetish import ResNetish\n\n\n"  # (the module beside the file, imported by name)
           "def build(num_classes=10, **kwargs):\n"
           "    return ResNetish(num_classes=num_classes, in_channels=1)\n")
STEPS = 3


@pytest.fixture(autouse=True)
def forget_the_copy(monkeypatch):
    """The copies imported here are the user's modules ``greynet`` and ``resnetish`` of this test's
    folder only (which the import puts on sys.path): later tests import the fixture itself under that
    name, which the loader refuses as a shadowing module."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("greynet", None), sys.modules.pop("resnetish", None)


def users_folder(tmp_path, monkeypatch) -> None:
    """Write the model into ``tmp_path/models`` and run the driver there (the actors cannot see it)."""
    assert not Path(MODEL.split(":")[0]).exists()  # (where the actors run)
    (tmp_path / "models").mkdir()
    shutil.copy(FIXTURE, tmp_path / "models" / "resnetish.py")
    (tmp_path / "models" / "greynet.py").write_text(GREYNET)
    monkeypatch.chdir(tmp_path)
    for name in ("resnetish", "greynet"):  # (imported from elsewhere by an earlier test: import these copies)
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.slow
def test_measuring_tasks_get_the_users_module(ray_cluster, tmp_path, monkeypatch):
    """--balance time measures layer times in a Ray task, as the planner does on a cluster: the task
    imports the user's module from py_modules, as the actors do."""
    users_folder(tmp_path, monkeypatch)
    logged: list[str] = []
    cfg = sgd_config(tmp_path, "bt", model=MODEL, pp=2, balance="time", num_microbatches=2, steps=1,
                     eval_every=1, loader_workers=0)
    summary = train_run(cfg, log=lambda *a: logged.append(" ".join(map(str, a))))
    assert summary["layout"]["pp"] == 2 and any("balanced by measured" in line for line in logged)
    meas = Measurements(plan_config(cfg), "cpu", use_cluster=True)
    meas.load()
    assert len(meas.times([(8, 1)])(8, 1)) == summary["layout"]["stages"][-1][1]  # (one time per layer)


@pytest.mark.slow
def test_users_model_dp2_equals_single_device_sgd_and_evaluates_from_init(ray_cluster, tmp_path, monkeypatch,
                                                                          capsys):
    users_folder(tmp_path, monkeypatch)
    cfg = sgd_config(tmp_path, "r", model=MODEL, dp=2, steps=STEPS, eval_every=STEPS, loader_workers=0)
    summary = train_run(cfg, log=lambda *_: None)
    assert summary["model"] == MODEL and summary["layout"]["dp"] == 2
    got = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    want, test_loss = reference_microbatch_sgd(cfg, STEPS)  # (built by the same function: build_model(MODEL))
    assert_same_state(got, want, atol=1e-10)
    assert abs(summary["test_loss"] - test_loss) < 1e-10
    assert summary["input_shape"] == [1, 8, 8]  # the digits' own channel: the one its first convolution takes
    model = resolve(MODEL)(num_classes=10)  # the user's own class, parameter names unchanged
    model.load_state_dict(got, strict=True)

    capsys.readouterr()
    rc = main(["--model", MODEL, "--evaluate-only", "--init", str(tmp_path / "r" / "model.pt"), "--dp", "2",
               "--precision", "fp64", "--device", "cpu", "--no-progress", "--loader-workers", "0",
               "--out", str(tmp_path / "e")])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0, captured.err
    ev = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert ev["steps"] == 0 and ev["evaluate_only"] and ev["init"] == str(tmp_path / "r" / "model.pt")
    assert ev["test_accuracy"] == summary["test_accuracy"]
    assert ev["test_top5_accuracy"] == summary["test_top5_accuracy"]
    # (--init's float64 weights enter the float64 run exactly: the same loss up to summation order)
    assert abs(ev["test_loss"] - summary["test_loss"]) < 1e-10
    assert f"test top-1 {summary['test_accuracy']:.4f}" in out
    assert not (tmp_path / "e" / "model.pt").exists()

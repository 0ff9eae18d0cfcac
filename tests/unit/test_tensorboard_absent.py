"""rayconv.outputs.tensorboard where the tensorboard package is missing or its import fails (a
protobuf or numpy it does not support): one console note, no event files, the run goes on. (Runs
without the package: test_tensorboard.py needs it.)"""

from __future__ import annotations

import sys

import pytest

from rayconv.outputs.metrics import MetricsLog
from rayconv.outputs.tensorboard import EventFiles


def rows(steps):
    log = MetricsLog()
    for k in steps:
        log.add(kind="train", step=k, epoch=0, loss=1.0, lr=0.1, images_per_s=100.0, input_stall_ms=0.5,
                loss_scale=None)
    return log.rows


def _no_tensorboard_imported(monkeypatch):
    loaded = [m for m in sys.modules
              if m == "tensorboard" or m.startswith(("tensorboard.", "torch.utils.tensorboard"))]
    for name in loaded:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("how", ["absent", "broken"])
def test_a_missing_or_broken_package_is_one_note(tmp_path, monkeypatch, how):
    _no_tensorboard_imported(monkeypatch)
    if how == "absent":
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)   # (an import of it fails)
    else:   # a tensorboard whose own import fails as an old one does under a newer protobuf
        pkg = tmp_path / "site" / "tensorboard"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise TypeError('Descriptors cannot be created directly.')\n")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
    notes = []
    events = EventFiles(tmp_path / "run", log=notes.append)
    events.add_rows(rows([0]))
    events.add_rows(rows([0, 1]))
    assert len(notes) == 1 and "pip install tensorboard" in notes[0], notes
    assert not (tmp_path / "run" / "tensorboard").exists()

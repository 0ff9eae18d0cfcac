"""Each example runs end to end with its smoke flag (3 steps) on the local CPU cluster."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").glob("*.py") if not p.name.startswith("_"))


def test_there_is_an_example_per_layout():
    names = {p.stem for p in EXAMPLES}
    assert {"data_parallel", "filter_split", "pipeline", "hybrid", "per_layer_plan"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_smoke(ray_cluster, tmp_path, monkeypatch, path):
    out = tmp_path / "run"
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setattr(sys, "argv", [str(path), "--smoke", "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    assert e.value.code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and (out / "model.pt").exists()

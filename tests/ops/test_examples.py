"""The examples: each passes its layout to ``rayconv.run`` as its docstring says, with flags that
validate; two of them (the simplest and the one with every pipeline-and-replica part) run end to end
with their smoke flag (3 steps) on the local CPU cluster, the pipeline-and-replica one first: the
simplest one's dp2 run then takes two of the four actors it kept (``--keep-actors-s``). Every layout the
examples use is checked against single-device SGD in test_data_parallel, test_model_parallel and
test_large_layouts."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

from rayconv.flags import parse_args
from support.helpers import slow_among

EXAMPLES = sorted(p for p in (Path(__file__).parents[2] / "examples").glob("*.py")
                  if not p.name.startswith("_"))
RUN_FULLY = ("hybrid_pipeline", "data_parallel")   # (in this order: the second takes the first's actors)

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)


def test_there_is_an_example_per_layout():
    names = {p.stem for p in EXAMPLES}
    assert {"data_parallel", "filter_split", "pipeline", "hybrid", "per_layer_plan"} <= names
    assert set(RUN_FULLY) <= names


def _run(path: Path, argv: list[str], monkeypatch) -> int:
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    return e.value.code


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_passes_the_layout_its_docstring_gives(tmp_path, monkeypatch, path):
    documented = re.search(r"# = python -m rayconv\.run (.+)", path.read_text())
    assert documented, f"{path.name}'s docstring should say which rayconv.run command it is"
    monkeypatch.syspath_prepend(str(path.parent))
    import _common

    passed: list[list[str]] = []
    monkeypatch.setattr(_common, "main", lambda argv: passed.append(list(argv)) or 0)
    assert _run(path, ["--smoke", "--out", str(tmp_path / "run")], monkeypatch) == 0
    layout = documented.group(1).split()
    assert passed[0][:len(layout)] == layout and passed[0][-3:] == ["--steps", "3", "--no-progress"]
    cfg = parse_args(passed[0])  # the flags validate (before any cluster)
    assert cfg.steps == 3 and cfg.out == str(tmp_path / "run")


@pytest.mark.parametrize(
    "path",
    slow_among(
        [p for name in RUN_FULLY for p in EXAMPLES if p.stem == name],
        [p for p in EXAMPLES if p.stem == "hybrid_pipeline"],
    ),
    ids=lambda p: p.stem,
)
def test_example_smoke(ray_cluster, tmp_path, monkeypatch, path):
    out = tmp_path / "run"
    assert _run(path, ["--smoke", "--out", str(out)], monkeypatch) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and (out / "model.pt").exists()

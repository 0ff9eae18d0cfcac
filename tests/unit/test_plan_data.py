"""The planner on the user's own data, without Ray: ``--max-memory-gib`` (and so ``--layout auto``)
plans with an image folder's own class count, ``python -m rayconv.plan`` takes ``--data imagefolder
--data-dir DIR`` as the run does, and a reused cache says when and on which machine it was measured
(``--remeasure`` measures anew)."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from PIL import Image

from rayconv.config import Config
from rayconv.plan import main
from rayconv.planner.search import memory_check, plan_config


@pytest.fixture
def three_classes(tmp_path):
    """An ImageNet-layout folder (train/ and val/) of three classes, four 36-pixel images each."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("ant", "bee", "cat"):
            (tmp_path / "imgs" / split / cls).mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)).save(
                    tmp_path / "imgs" / split / cls / f"{i}.png")
    return str(tmp_path / "imgs")


def test_memory_check_plans_with_the_folders_classes(three_classes):
    cfg = Config(model="convnet", data="imagefolder", data_dir=three_classes, image_size=32, dp=1,
                 max_memory_gib=100, device="cpu").validate()
    assert plan_config(cfg).num_classes is None  # (follows the folder, as the run does)
    memory_check(cfg)  # (refused its own settings: "--num-classes 1000 but --data imagefolder has 3 classes")
    with pytest.raises(Exception, match="GiB per device"):
        memory_check(Config(**{**cfg.to_dict(), "max_memory_gib": 1e-6}).validate())


def test_plan_takes_the_runs_data_flags_and_dates_its_cache(three_classes, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["--device", "cpu", "--model", "convnet", "--data", "imagefolder", "--data-dir", three_classes,
            "--image-size", "32", "--global-batch-size", "8", "--top", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "reusing measurements" not in first and "; measured " in first
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "reusing measurements made 20" in second and f"UTC on {platform.node()} (" in second
    assert "all measurements from the cache" in second
    assert main([*argv, "--remeasure"]) == 0
    third = capsys.readouterr().out
    assert "reusing measurements" not in third and "; measured " in third


def test_plan_refuses_a_folder_data_without_its_folder(capsys):
    assert main(["--device", "cpu", "--data", "shards"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--data-dir" in err

"""``whole_state(path)``, read from Python without Ray, refuses a path that is not a checkpoint in one line
that names its argument and what to pass instead, never the command line's ``--resume``."""

from __future__ import annotations

import pytest

from rayconv.errors import CheckpointError
from rayconv.outputs.checkpoint import whole_state, write_checkpoint


def refusal(path) -> str:
    with pytest.raises(CheckpointError) as e:
        whole_state(path)
    line = str(e.value)
    assert "\n" not in line and "--resume" not in line and "resume from" not in line, line
    return line


def test_a_path_that_is_not_a_checkpoint_is_refused_for_the_caller(tmp_path):
    assert refusal(tmp_path / "nowhere") == (
        f"whole_state's path {tmp_path / 'nowhere'}: no such folder: give a run folder (with checkpoints/) "
        "or one of its checkpoints/step-<k> folders")
    (tmp_path / "a-file").write_text("x")
    assert "is a file: give a run folder or a checkpoints/step-<k> folder" in refusal(tmp_path / "a-file")
    (tmp_path / "empty").mkdir()
    assert "holds no complete checkpoint" in refusal(tmp_path / "empty")
    unfinished = tmp_path / "r0" / "checkpoints" / "step-4"
    unfinished.mkdir(parents=True)
    assert f"never finished (no manifest.json): give its run folder {tmp_path / 'r0'} instead" in \
        refusal(unfinished)


def test_a_damaged_checkpoint_asks_for_another(tmp_path):
    ckpt = write_checkpoint(tmp_path / "r1", 2, [b"rank file"], {"layout": {}})
    (ckpt / "rank-0.pt").write_bytes(b"rank fil!")
    assert refusal(tmp_path / "r1").endswith("is corrupt (sha256 differs from the manifest): give another "
                                             "checkpoint")


def test_the_package_names_it():
    import rayconv

    assert rayconv.whole_state is whole_state and "whole_state" in rayconv.__all__

"""``--data shards --data-dir DIR`` on an image folder that was never prepared (no manifest.json): the
error names a ``python -m rayconv.prepare`` command whose ``--out`` prepare accepts, and the folder it
writes is then read as shards (the image folder itself, holding train/ and val/, is refused as --out)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rayconv.data.shard_files import read_manifest
from rayconv.data.shard_writer import prepare
from rayconv.errors import DataError


def test_the_hint_for_a_folder_without_manifest_names_an_out_prepare_accepts(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "pets"
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (root / split / cls).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(
                root / split / cls / "0.png"
            )
    with pytest.raises(DataError) as e:
        read_manifest(root)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    cmd = shlex.split(re.search(r"`(python -m rayconv\.prepare [^`]*)`", msg).group(1))
    src, out = cmd[3], cmd[cmd.index("--out") + 1]
    assert Path(src) == root and Path(out) != root
    with pytest.raises(DataError, match="holds files prepare did not write"):
        prepare(str(root), str(root), size=16, shard_size=10, log=lambda *_: None, processes=1)
    prepare(src, out, size=16, shard_size=10, log=lambda *_: None, processes=1)
    assert read_manifest(Path(out))["format"]
    assert "--data-dir" in msg

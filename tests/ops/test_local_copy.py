"""``--stage-dir``: a prepared shard folder copied to each node's disk (rayconv/cluster/local_copy.py), on the
local cluster and on two Ray nodes: copies checked by sha256, skipped when already there, a corrupted
copy copied again, a full disk (a real file-size limit in a subprocess) leaving nothing taken as
complete, and a run that trains from the copies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rayconv.cluster.local_copy import is_copied, copy_folder, copy_to_nodes
from rayconv.config import Config
from rayconv.data.registry import make_source
from rayconv.driver.job import train_run
from rayconv.errors import DataError
from rayconv.files import folder_lock
from support.shard_folder import make_prepared


@pytest.fixture(scope="module")
def prepared(ray_cluster, tmp_path_factory) -> Path:
    return make_prepared(tmp_path_factory.mktemp("stage"))


def listed(folder: Path) -> list[dict]:
    m = json.loads((folder / "manifest.json").read_text())
    return [e for split in m["splits"].values() for e in split["shards"]]


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all((a / n).read_bytes() == (b / n).read_bytes()
                                                                for n in names)


@pytest.mark.slow
def test_copied_checked_then_skipped_and_a_bad_copy_copied_again(prepared, tmp_path):
    dest = tmp_path / "local"
    entries = listed(prepared)
    first = copy_folder(str(prepared), str(dest))
    assert first["copied"] == sorted(e["file"] for e in entries) and first["skipped"] == []
    assert same_files(prepared, dest)
    again = copy_folder(str(prepared), str(dest))
    assert again["copied"] == [] and len(again["skipped"]) == len(entries)
    # One copy changed in place (same size), one truncated, a shard of an older preparation and a
    # crash's temporary file left in DIR: the two are copied again, the others removed.
    bad, short = dest / entries[1]["file"], dest / entries[-1]["file"]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:10])
    (dest / "train-00999.arrow").write_bytes(b"old")
    (dest / f".{entries[0]['file']}.abc123").write_bytes(b"partial")
    third = copy_folder(str(prepared), str(dest))
    assert third["copied"] == sorted([bad.name, short.name])
    assert same_files(prepared, dest)
    # DIR given as --data-dir too (a resumed run's settings): checked, nothing touched.
    assert copy_folder(str(dest), str(dest))["copied"] == []
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"is --data-dir itself and {bad.name}"):
        copy_folder(str(dest), str(dest))
    assert (dest / "manifest.json").is_file()


def test_a_full_disk_leaves_no_file_taken_as_complete(prepared, tmp_path):
    """The copy in a subprocess under RLIMIT_FSIZE (SIGXFSZ ignored, so a write past it fails with
    EFBIG): DataError names the file and DIR; DIR holds no manifest and no shard under its name that
    is not complete; a later staging without the limit completes it."""
    dest = tmp_path / "full"
    entries = listed(prepared)
    limit = min(e["bytes"] for e in entries if e["bytes"] > 0) // 2
    code = ("import resource, signal, sys\n"
            "from rayconv.cluster.local_copy import copy_folder\n"
            "from rayconv.errors import DataError\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "try:\n"
            f"    copy_folder({str(prepared)!r}, {str(dest)!r})\n"
            "except DataError as e:\n"
            "    print(e, file=sys.stderr); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert str(dest) in line and entries[0]["file"] in line and "File too large" in line, line
    assert not (dest / "manifest.json").exists()
    by_name = {e["file"]: e for e in entries}
    for p in dest.iterdir():   # no temporary file left, nothing incomplete under a shard's name
        assert p.name in by_name and is_copied(p, by_name[p.name]), p.name
    cfg = Config(data="shards", data_dir=str(dest), image_size=32, device="cpu", loader_workers=0).validate()
    with pytest.raises(DataError, match="manifest.json"):
        make_source(cfg)
    assert len(copy_folder(str(prepared), str(dest))["copied"]) == len(entries)
    assert same_files(prepared, dest)


def test_too_little_space_is_refused_before_copying(prepared, tmp_path, monkeypatch):
    dest = tmp_path / "small"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    with pytest.raises(DataError, match=r"--stage-dir .*small: 0\.\d MiB to copy but 0\.0 MiB free"):
        copy_folder(str(prepared), str(dest))
    assert list(dest.iterdir()) == []


@pytest.mark.slow
def test_a_run_trains_from_the_staged_copy(ray_cluster, prepared, tmp_path):
    """The run stages, then reads only DIR: the given folder is moved away after the first step, and
    the remaining steps and the evaluation still read their shards."""
    src = tmp_path / "given"
    shutil.copytree(prepared, src)
    dest, moved = tmp_path / "local", tmp_path / "moved"
    logged: list[str] = []

    def move_away(actor_group, step):
        if step == 0:
            src.rename(moved)

    cfg = Config(model="convnet", data="shards", data_dir=str(src), stage_dir=str(dest), image_size=32, dp=2,
                 global_batch_size=6, steps=4, eval_every=4, device="cpu", progress=False, loader_workers=1,
                 decode="cpu", data_on_device="off", out=str(tmp_path / "run")).validate()
    summary = train_run(cfg, log=lambda *a: logged.append(" ".join(map(str, a))), on_step=move_away)
    assert summary["data_dir"] == str(src) and summary["stage_dir"] == str(dest)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())  # a resume stages again from src
    assert saved["data_dir"] == str(src) and saved["stage_dir"] == str(dest)
    assert summary["test_accuracy"] is not None and same_files(moved, dest)
    assert any("--stage-dir" in line and "1 node(s)" in line and "copied" in line for line in logged), logged


def test_a_second_copy_into_a_locked_folder_waits(prepared, tmp_path):
    """The folder's flock: a copy into DIR while another holder has it waits, writing nothing, then
    finishes once it is released."""
    dest = tmp_path / "locked"
    dest.mkdir()
    done: list[dict] = []
    with folder_lock(dest):
        worker = threading.Thread(target=lambda: done.append(copy_folder(str(prepared), str(dest))))
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and not done and list(dest.iterdir()) == []
    worker.join(timeout=60)
    assert len(done[0]["copied"]) == len(listed(prepared)) and same_files(prepared, dest)


def test_every_node_of_two_gets_a_copy(prepared, two_nodes, tmp_path):
    """Two Ray nodes (conftest's ``two_nodes``): one task per node."""
    logged: list[str] = []
    cfg = Config(data="shards", data_dir=str(prepared), stage_dir=str(tmp_path / "d"),
                 device="cpu").validate()
    staged = copy_to_nodes(cfg, log=logged.append)
    assert staged.data_dir == str(tmp_path / "d") and "2 node(s)" in logged[0], logged
    n = len(listed(prepared))  # (both nodes share this host's disk: one copies, the other finds the copies)
    assert f"{n} file(s) copied" in logged[0] and f", {n} already there" in logged[0], logged
    assert same_files(prepared, tmp_path / "d")

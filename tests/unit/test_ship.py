"""A user's modules shipped to the actors (``cluster.ship``): one zip named by its content, unpacked once
per node and content, first on ``sys.path``; the runtime environment names the content, not the paths."""

from __future__ import annotations

import importlib
import io
import os
import sys
import zipfile

import pytest

from rayconv.cluster import ship
from rayconv.errors import ClusterError


def test_the_zip_is_named_by_its_content_and_unpacks_importable(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "shipped_pkg_xyz" / "__pycache__").mkdir(parents=True)
    (src / "shipped_pkg_xyz" / "__init__.py").write_text("from .inner import VALUE\n")
    (src / "shipped_pkg_xyz" / "inner.py").write_text("VALUE = 7\n")
    (src / "shipped_pkg_xyz" / "__pycache__" / "inner.cpython-311.pyc").write_bytes(b"stale")
    (src / "shipped_file_xyz.py").write_text("NAME = 'file'\n")
    paths = [str(src / "shipped_pkg_xyz"), str(src / "shipped_file_xyz.py")]
    digest, data = ship.pack(paths)
    os.utime(src / "shipped_file_xyz.py", (0, 0))          # (times do not count, nor the order given)
    assert ship.pack(list(reversed(paths)))[0] == digest
    (src / "shipped_pkg_xyz" / "inner.py").write_text("VALUE = 8\n")
    assert ship.pack(paths)[0] != digest                     # (content does)

    monkeypatch.setenv(ship.MODULES_ENV, digest)
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = ship.unpack(data, root=tmp_path / "node")
    assert folder == tmp_path / "node" / digest and sys.path[0] == str(folder)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "shipped_file_xyz.py", "shipped_pkg_xyz/__init__.py", "shipped_pkg_xyz/inner.py"]
    try:
        assert importlib.import_module("shipped_pkg_xyz").VALUE == 7
        assert importlib.import_module("shipped_file_xyz").NAME == "file"
    finally:
        for name in ("shipped_pkg_xyz", "shipped_pkg_xyz.inner", "shipped_file_xyz"):
            sys.modules.pop(name, None)
    (folder / "shipped_file_xyz.py").write_text("NAME = 'unpacked before'\n")
    assert ship.unpack(data, root=tmp_path / "node") == folder and sys.path.count(str(folder)) == 1
    assert (folder / "shipped_file_xyz.py").read_text() == "NAME = 'unpacked before'\n"   # (once per node)
    assert ship.unpack(None) is None


def test_an_environment_without_modules_is_left_as_it_is():
    assert ship.with_modules(None) is None
    env = {"env_vars": {"X": "1"}}
    assert ship.with_modules(env) is env and ship.modules(env) is None


def test_what_a_gitignore_names_is_left_out(tmp_path):
    """As Ray's own upload of a working_dir: a .gitignore (or .rayignore) in the packed folder or a subfolder
    leaves out what it names, folders (``data/``) and globs (``*.pt``) at any depth; the rest is shipped
    and hashed as before."""
    pkg = tmp_path / "model_pkg"
    for name in ("data/train.bin", "data/sub/more.bin", "nets/data/ok.py", "ckpt.pt", "nets/best.pt",
                 "nets/venv/lib.py", "__init__.py", "nets/__init__.py", "nets/block.py", "nets/data.pt.txt"):
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(name)
    (pkg / ".gitignore").write_text("# the data beside the code\ndata/\n*.pt\n")
    (pkg / "nets" / ".rayignore").write_text("/venv\n")
    digest, data = ship.pack([str(pkg)])
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert sorted(z.namelist()) == ["model_pkg/.gitignore", "model_pkg/__init__.py",
                                        "model_pkg/nets/.rayignore", "model_pkg/nets/__init__.py",
                                        "model_pkg/nets/block.py", "model_pkg/nets/data.pt.txt"]
    (pkg / "data" / "train.bin").write_text("other data")
    assert ship.pack([str(pkg)])[0] == digest   # (what is left out does not change the hash)


def test_too_much_to_ship_is_refused_naming_the_biggest_files(tmp_path, monkeypatch):
    pkg = tmp_path / "heavy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "weights.bin").write_bytes(bytes(3000))
    monkeypatch.setattr(ship, "MAX_BYTES", 2000)
    with pytest.raises(ClusterError) as e:
        ship.with_modules({"py_modules": [str(pkg)]})
    msg = str(e.value)
    assert "\n" not in msg and "heavy_pkg/weights.bin" in msg and ".gitignore" in msg
    (pkg / ".gitignore").write_text("*.bin\n")
    assert ship.pack([str(pkg)])[1]   # (left out, it fits)

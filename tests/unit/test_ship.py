"""A user's modules shipped to the actors (``cluster.ship``): one zip named by its content, unpacked once
per node and content, first on ``sys.path``; the runtime environment names the content, not the paths."""

from __future__ import annotations

import importlib
import os
import sys

from rayconv.cluster import ship


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

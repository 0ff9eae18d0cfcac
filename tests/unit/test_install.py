"""``pip install -e .`` of this pyproject.toml makes ``import rayconv`` find the clone's package from a
script in the folder that holds the clone, where the clone's own folder (``rayconv/``, with no
``__init__.py``) would otherwise be imported as a namespace package ahead of the editable install.
Installed into a temporary prefix (no dependencies, no build isolation: no network; --ignore-installed, so
the rayconv installed where the tests run stays installed) and imported by a
Python without site-packages but that prefix's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_an_editable_install_wins_over_the_clone_folder_in_the_current_directory(tmp_path):
    pytest.importorskip("setuptools", minversion="68")  # (pyproject's build requirement, used in place)
    clone = tmp_path / "holder" / "rayconv"                 # the folder holding the clone, the clone
    (clone / "rayconv" / "sub").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", clone)
    (clone / "README.md").write_text("readme\n")
    (clone / "rayconv" / "__init__.py").write_text("fit = 'the regular package'\n")
    (clone / "rayconv" / "sub" / "__init__.py").write_text("")
    prefix = tmp_path / "prefix"
    installed = _installed_here(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--ignore-installed",
            "--prefix",
            str(prefix),
            "-e",
            str(clone),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        _installed_here(tmp_path) == installed
    ), "the install into the prefix removed the rayconv installed here"
    site = next(prefix.glob("lib/python*/site-packages"))
    script = tmp_path / "holder" / "script.py"              # sys.path[0]: the folder holding the clone
    script.write_text(
        f"import site\nsite.addsitedir({str(site)!r})\nimport rayconv, rayconv.sub\nprint(rayconv.fit)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "-S", str(script)], capture_output=True, text=True,
                         cwd=script.parent, env=env)
    assert ran.returncode == 0 and ran.stdout.strip() == "the regular package", ran.stderr[-2000:]


def _installed_here(cwd: Path) -> str | None:
    """Where this environment's installed rayconv distribution lives (None: not installed), read afresh
    by a subprocess run in ``cwd`` (this process caches distributions; a clone's own rayconv.egg-info in
    the current directory would be found too)."""
    code = (
        "import importlib.metadata as m\ntry: print(m.distribution('rayconv')._path)\nexcept"
        " m.PackageNotFoundError: print('')"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                         env=env).stdout.strip()
    return out or None

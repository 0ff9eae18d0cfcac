"""A user's modules shipped to the actors and tasks that build the user's model, through Ray's object
store.

Ray puts local ``py_modules`` paths on its workers' ``sys.path`` only for a job's runtime environment
(``ray.init``); an actor's or a task's must name URIs, and the driver may be connected already (by its
own ``ray.init``, or as a Tune trial). So the driver ships them itself (``with_modules``): each folder (a
package) or ``.py`` file, by its name, in one zip (``pack``), put in the object store once per content
and cluster (``ray.put``: the driver's process owns it), and named in the runtime environment by the
hash of its content (``MODULES_ENV``: other content, another environment, so another worker process and
another ``pool.actors_key``). The actor or task, handed the zip (``modules``: Ray fetches it to its
node), unpacks it once per node and content into ``<temp dir>/rayconv-modules/<hash>/`` and puts that
folder first on ``sys.path`` (``unpack``) before it imports the user's model.

Left out of a packed folder, as Ray's own ``working_dir`` upload leaves them: ``__pycache__`` and ``.git``
folders, and what a ``.gitignore`` or ``.rayignore`` in the folder or a subfolder names (data, virtual
environments, checkpoints beside the model's code; ``ignored``). More than ``MAX_BYTES`` to ship is
refused in one line naming the biggest files.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import io
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional

import ray

from rayconv.errors import ClusterError, ConfigError, first_line

MODULES_ENV = "RAYCONV_MODULES"   # the hash of the shipped modules' content (an actor's environment)
SKIP = {"__pycache__", ".git"}
IGNORE_FILES = (".gitignore", ".rayignore")   # their patterns leave files out of a packed folder
MAX_BYTES = 100 * 2**20   # the most a zip may hold (uncompressed): larger, it is data, not modules
_PUT: dict[tuple[str, str], Any] = {}   # (cluster's GCS address, hash) -> the zip's ObjectRef


def ignored(path: Path, rules: list[tuple[Path, str]]) -> bool:
    """Whether ``rules`` ((folder of the ignore file, pattern) pairs) leave out ``path``. The patterns
    are gitignore's common forms: ``name`` or ``*.glob`` matches a name at any depth below its folder;
    one with a ``/`` inside or in front (``/build``, ``data/*.bin``) a path from that folder; a trailing
    ``/`` matches folders only; ``**/`` in front is any depth. ``!`` (re-including) is not supported:
    such a line is skipped (what an earlier line left out stays out)."""
    for folder, pattern in rules:
        if pattern.endswith("/") and not path.is_dir():
            continue
        pattern = pattern.rstrip("/")
        pattern = pattern[3:] if pattern.startswith("**/") else pattern
        target = path.relative_to(folder).as_posix() if "/" in pattern else path.name
        if fnmatch.fnmatchcase(target, pattern.lstrip("/")):
            return True
    return False


def _files(folder: Path, rules: list[tuple[Path, str]]) -> list[Path]:
    """The files under ``folder`` to ship, in path order: not in ``SKIP`` folders nor left out by
    ``rules`` or the ignore files of ``folder`` and its subfolders (``ignored``)."""
    for name in IGNORE_FILES:
        if (folder / name).is_file():
            lines = (line.strip() for line in (folder / name).read_text(errors="replace").splitlines())
            rules = rules + [(folder, line) for line in lines if line and line[0] not in "#!"]
    out = []
    for entry in sorted(folder.iterdir()):
        if entry.name in SKIP or ignored(entry, rules):
            continue
        if entry.is_dir() and not entry.is_symlink():   # (as rglob: a link to a folder is not followed)
            out += _files(entry, rules)
        elif entry.is_file():
            out.append(entry)
    return out


def pack(paths: list[str]) -> tuple[str, bytes]:
    """(hash of the content, zip) of ``paths`` (folders and ``.py`` files), each under its own name: the
    same files give the same hash (names and bytes, in a fixed order), whatever their times. Raises
    ConfigError when the files to ship hold more than ``MAX_BYTES``, naming the biggest."""
    files = []   # (name in the zip, file)
    for path in sorted(Path(p) for p in paths):
        files += [(path.name, path)] if path.is_file() else [
            (f"{path.name}/{f.relative_to(path).as_posix()}", f) for f in _files(path, [])]
    sizes = {name: f.stat().st_size for name, f in files}
    if sum(sizes.values()) > MAX_BYTES:
        big = sorted(sizes, key=sizes.__getitem__, reverse=True)[:3]
        listed = ", ".join(f"{n} ({sizes[n] / 2**20:.1f} MB)" for n in big)
        raise ConfigError(f"{sum(sizes.values()) / 2**20:.0f} MB to ship, over {MAX_BYTES / 2**20:.0f} MB; "
                          f"biggest: {listed}: add them to a .gitignore in their folder, or move them out "
                          "of the model's folder")
    h = hashlib.sha256()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, f in files:
            data = f.read_bytes()
            h.update(name.encode() + b"\0" + data + b"\0")
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
            z.writestr(info, data)
    return h.hexdigest()[:16], buf.getvalue()


def with_modules(env: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``env`` (a runtime environment) with its ``py_modules`` (local paths) shipped: packed, put in the
    object store (once per content and cluster) and named by ``MODULES_ENV`` in its ``env_vars``
    instead; ``modules(env)`` is then what the actor is handed. Raises ClusterError when a path cannot
    be read, the files to ship exceed ``MAX_BYTES`` or the object store refuses the zip."""
    if not env or not env.get("py_modules"):
        return env
    paths = list(env["py_modules"])
    try:
        digest, data = pack(paths)
        where = (ray.get_runtime_context().gcs_address, digest)
        if where not in _PUT:
            _PUT[where] = ray.put(data)
    except Exception as e:  # noqa: BLE001 - any failure to ship is reported in one line
        raise ClusterError(f"could not ship {', '.join(paths)} to the cluster: {first_line(e)}") from None
    out = {k: v for k, v in env.items() if k != "py_modules"}
    out["env_vars"] = {**env.get("env_vars", {}), MODULES_ENV: digest}
    return out


def modules(env: Optional[dict[str, Any]]) -> Optional[Any]:
    """The zip's ObjectRef for an actor or task of ``env`` (``with_modules``' output); None when it
    ships none."""
    digest = ((env or {}).get("env_vars") or {}).get(MODULES_ENV)
    if digest is None:
        return None
    return _PUT[(ray.get_runtime_context().gcs_address, digest)]


def unpack(data: Optional[bytes], root: Optional[Path] = None) -> Optional[Path]:
    """On an actor or task: the shipped zip ``data`` (None: nothing shipped) unpacked into
    ``root/<hash>`` (``root``: ``<temp dir>/rayconv-modules``; the hash: ``MODULES_ENV``'s, else the
    zip's own) unless there already, and that folder first on ``sys.path``. Returns the folder."""
    if data is None:
        return None
    digest = os.environ.get(MODULES_ENV) or hashlib.sha256(data).hexdigest()[:16]
    folder = (root or Path(tempfile.gettempdir()) / "rayconv-modules") / digest
    if not folder.is_dir():
        partial = folder.with_name(f"{digest}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            z.extractall(partial)
        try:
            partial.rename(folder)
        except OSError:   # (another process of the node unpacked it first)
            shutil.rmtree(partial, ignore_errors=True)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
        importlib.invalidate_caches()
    return folder

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
folder first on ``sys.path`` (``unpack``) before it imports the user's model. ``__pycache__`` and
``.git`` folders are left out.
"""

from __future__ import annotations

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

from rayconv.errors import ClusterError, first_line

MODULES_ENV = "RAYCONV_MODULES"   # the hash of the shipped modules' content (an actor's environment)
SKIP = {"__pycache__", ".git"}
_PUT: dict[tuple[str, str], Any] = {}   # (cluster's GCS address, hash) -> the zip's ObjectRef


def pack(paths: list[str]) -> tuple[str, bytes]:
    """(hash of the content, zip) of ``paths`` (folders and ``.py`` files), each under its own name: the
    same files give the same hash (names and bytes, in a fixed order), whatever their times."""
    h = hashlib.sha256()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(Path(p) for p in paths):
            files = [path] if path.is_file() else sorted(
                f for f in path.rglob("*") if f.is_file() and not SKIP & set(f.relative_to(path).parts))
            for f in files:
                name = path.name if f == path else f"{path.name}/{f.relative_to(path).as_posix()}"
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
    be read or the object store refuses the zip."""
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

"""``--stage-dir DIR``: a prepared shard folder copied to the local disk of each node before training.

``copy_to_nodes`` (the driver, once Ray is connected and the device kind known) starts one Ray task per
alive node that can host an actor of the run (a GPU for ``cuda``, ``--num-cpus-per-actor`` CPUs
otherwise; the placement group is reserved later, so every such node gets a copy), pinned to it by a
hard ``NodeAffinitySchedulingStrategy``. Each task (``copy_folder``) reads the folder at
``--data-dir`` (a path that node sees, or a bucket's URI: read with that node's credentials through
``rayconv.storage``) and brings DIR to an exact copy of its listed files:

- a shard already in DIR with the manifest's byte size and sha256 is skipped; any other is copied
  to a temporary name in DIR, hashed while copied, fsynced, checked against the manifest's sha256 and
  renamed over its name (a rename in one folder is atomic), so a shard under its own name in DIR is
  always complete;
- DIR's manifest is removed before any shard is copied and written (atomically) after all of them,
  so a DIR whose copy stopped part-way (full disk, a crash) has no manifest and is refused by the
  reader rather than taken as complete;
- the copy holds an exclusive ``flock`` on DIR, so two tasks copying into one folder (two Ray nodes
  of one host, or a DIR on a disk the nodes share) run one after the other: the second finds the
  shards there and skips them, and neither removes the other's temporary files;
- shard files in DIR that the manifest does not list (``train-NNNNN`` / ``val-NNNNN`` of an earlier
  preparation) are removed, as the reader refuses unlisted shards.

Before copying, the bytes to copy are checked against ``shutil.disk_usage(DIR).free``; an OSError
while copying removes the temporary file. Both raise DataError naming the file and DIR. The run then
reads DIR: the driver's settings take ``data_dir = DIR`` (the folder given is kept in ResolvedRun.data_dir
for summary.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayconv.cluster.connect import exception_summary
from rayconv.config import Config
from rayconv.data.cache import remote_manifest
from rayconv.data.shards import MANIFEST
from rayconv.errors import ClusterError, DataError
from rayconv.files import atomic_write, folder_lock, sha256_file
from rayconv.settings import ClusterSettings
from rayconv.storage import is_remote

SHARD_NAME = re.compile(r"^(train|val)-\d+\.(parquet|arrow)$")  # what prepare names its shards
BLOCK = 1 << 22  # bytes read and written at a time


def copy_to_nodes(cfg: Config, log=print) -> Config:
    """With ``cfg.stage_dir``: copy ``cfg.data_dir`` on every node that can host an actor (see the
    module docstring) and return ``cfg`` reading the copies (``data_dir = stage_dir``); without it,
    ``cfg`` itself. Raises DataError (a node's copy failed: the message names the file and DIR) or
    ClusterError (no node can host an actor, or Ray failed)."""
    if not cfg.stage_dir:
        return cfg
    nodes = actor_nodes(cfg)
    if not nodes:
        raise ClusterError(f"--stage-dir {cfg.stage_dir}: no alive node of the cluster can host an actor")
    task = ray.remote(copy_folder)
    refs = [task.options(num_cpus=0, max_retries=0,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                         ).remote(cfg.data_dir, cfg.stage_dir) for node in nodes]
    try:
        reports = ray.get(refs)
    except ray.exceptions.RayError as e:
        cause: BaseException = e
        while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
            cause = cause.cause
        if isinstance(cause, DataError):
            raise DataError(str(cause)) from None
        raise ClusterError(f"--stage-dir {cfg.stage_dir}: copying failed: {exception_summary(e)}") from None
    copied = sum(len(r["copied"]) for r in reports)
    gib = sum(r["copied_bytes"] for r in reports) / 2**30
    log(f"--stage-dir {cfg.stage_dir}: {len(reports)} node(s); {copied} file(s) copied ({gib:.2f} GiB), "
        f"{sum(len(r['skipped']) for r in reports)} already there with their sha256")
    return dataclasses.replace(cfg, data_dir=cfg.stage_dir)


def actor_nodes(cfg: ClusterSettings) -> list[str]:
    """Node ids of the alive nodes with the resources of one actor of ``cfg`` (device resolved)."""
    need = ("GPU", 1) if cfg.device == "cuda" else ("CPU", cfg.num_cpus_per_actor)
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(need[0], 0) >= need[1]]


def copy_folder(src: str, dest: str) -> dict[str, Any]:
    """Make ``dest`` on this node an exact copy of the prepared folder ``src`` (module docstring).
    Returns {"node": this node's IP, "copied": [file names], "skipped": [file names], "copied_bytes"}.
    Raises DataError naming the file and ``dest``."""
    out = Path(dest)
    root: Any = Path(src) if not is_remote(src) else None
    if root is None:   # a bucket: its manifest and shards read through the storage (rayconv.storage)
        root, manifest_bytes, manifest = remote_manifest(src)
        entries = [e for split in manifest["splits"].values() for e in split["shards"]]
    else:
        manifest_bytes, entries = _read_manifest(root)
    if isinstance(root, Path) and out.exists() and out.resolve() == root.resolve():  # (--data-dir is DIR)
        bad = [e["file"] for e in entries if not is_copied(out / e["file"], e)]
        if bad:
            raise DataError(
                f"--stage-dir {out} is --data-dir itself and {bad[0]} there does not match {MANIFEST}: "
                "give --data-dir the prepared folder it was copied from")
        return {"node": _node(), "copied": [], "skipped": sorted(e["file"] for e in entries),
                "copied_bytes": 0}
    with contextlib.ExitStack() as held:
        try:
            out.mkdir(parents=True, exist_ok=True)
            held.enter_context(folder_lock(out))  # (two nodes of one host, or a shared disk: one at a time)
        except OSError as e:
            raise DataError(f"--stage-dir {out}: cannot prepare the folder ({e.strerror or e})") from None
        return _copy_locked(root, out, manifest_bytes, entries)


def _copy_locked(root: Any, out: Path, manifest_bytes: bytes, entries: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """copy_folder's work, with ``out`` locked."""
    try:
        listed = {e["file"] for e in entries}
        for p in out.iterdir():  # earlier shards the manifest no longer lists, and tmp files of a crash
            if (SHARD_NAME.match(p.name) and p.name not in listed) or \
                    any(p.name.startswith(f".{name}.") for name in listed | {MANIFEST}):
                p.unlink()
    except OSError as e:
        raise DataError(f"--stage-dir {out}: cannot prepare the folder ({e.strerror or e})") from None
    todo = [e for e in entries if not is_copied(out / e["file"], e)]
    manifest_current = (out / MANIFEST).is_file() and (out / MANIFEST).read_bytes() == manifest_bytes
    if todo or not manifest_current:
        (out / MANIFEST).unlink(missing_ok=True)  # DIR is incomplete until the manifest is written back
        check_space(out, sum(int(e["bytes"]) for e in todo) + len(manifest_bytes))
    for e in todo:
        copy_checked(root / e["file"], out, e["sha256"])
    if todo or not manifest_current:
        _copy_guarded(out / MANIFEST, lambda tmp: Path(tmp).write_bytes(manifest_bytes), out)
    copied = {e["file"] for e in todo}
    return {"node": _node(),
            "copied": sorted(copied), "skipped": sorted(listed - copied),
            "copied_bytes": sum(int(e["bytes"]) for e in todo)}


def _node() -> str | None:
    return ray.util.get_node_ip_address() if ray.is_initialized() else None


def _read_manifest(root: Path) -> tuple[bytes, list[dict[str, Any]]]:
    """(the manifest's bytes, every split's shard entries). Raises DataError."""
    path = root / MANIFEST
    try:
        data = path.read_bytes()
        entries = [e for split in json.loads(data)["splits"].values() for e in split["shards"]]
        assert all(
            {"file", "bytes", "sha256"} <= set(e) for e in entries
        ), "a shard entry lacks file/bytes/sha256"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
        raise DataError(f"--stage-dir: {path} cannot be read as a shard manifest ({e}): give --data-dir a "
                        "folder written by python -m rayconv.prepare, readable on every node") from None
    return data, entries


def is_copied(path: Path, entry: dict[str, Any]) -> bool:
    """Whether ``path`` is complete: the entry's byte size and sha256."""
    try:
        return path.stat().st_size == int(entry["bytes"]) and sha256_file(path) == entry["sha256"]
    except OSError:
        return False


def check_space(out: Path, needed: int) -> None:
    """Raise DataError when ``out``'s disk has fewer than ``needed`` bytes free."""
    free = shutil.disk_usage(out).free
    if free < needed:
        raise DataError(
            f"--stage-dir {out}: {_size(needed)} to copy but {_size(free)} free on its disk: free "
            "space there or choose another --stage-dir (nothing was copied)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def copy_checked(src: Any, out: Path, sha256: str) -> None:
    """Copy ``src`` (a Path, or a ``rayconv.storage.Location`` in a bucket) into folder ``out`` under its
    name: through a temporary file, hashed while copied, fsynced, renamed once its sha256 is ``sha256``.
    Raises DataError (the temporary file removed)."""
    def write(tmp: str) -> None:
        h = hashlib.sha256()
        opened = open(src, "rb") if isinstance(src, Path) else src.fs.open_input_stream(src.path)
        with opened as fi, open(tmp, "wb") as fo:
            for block in iter(lambda: fi.read(BLOCK), b""):
                h.update(block)
                fo.write(block)
            fo.flush()
            os.fsync(fo.fileno())
        if h.hexdigest() != sha256:
            folder = src.parent if isinstance(src, Path) else str(src).rsplit("/", 1)[0]
            raise DataError(f"--stage-dir: {src} does not match its sha256 in {MANIFEST}: run `python -m "
                            f"rayconv.prepare` again with --out {folder} (it rewrites bad shards)")

    _copy_guarded(out / src.name, write, out)


def _copy_guarded(path: Path, write, out: Path) -> None:
    """``atomic_write(path, write)`` with the folder fsynced after the rename; an OSError (a full disk,
    a file-size limit, a read error) raises DataError naming the file and ``out``."""
    try:
        atomic_write(path, write)
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise DataError(
            f"--stage-dir {out}: copying {path.name} failed ({e.strerror or e}); nothing incomplete "
            "was left under its name: free space there or choose another --stage-dir") from None

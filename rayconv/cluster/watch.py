"""The watchdog inside an actor that may outlive its driver (``cluster.across``: kept on the cluster
for the next command).

Such an actor and its placement group are detached (Ray's ``lifetime="detached"``): Ray stops neither
when the command that started them ends, or crashes. So each of them watches itself, in a daemon
thread polling every ``POLL_S`` seconds:

    in use   by a run whose driver is the Ray job ``job``: once that job is dead (the command was
             killed, its machine lost) the actor ends (``_end``)
    kept     by a run that ended normally (``keep``): unclaimed ``keep_s`` seconds later it ends; a
             command's ``claim`` (once, atomic under the lock) puts it in use by that command's job

``_end`` removes the group's placement group (every actor of the group tries: safe to repeat; the
removal stops the group's other actors too), drops the group's entry in Ray's key-value store
(``cluster.across``'s registry of kept groups) and ends the process. Whether a job is alive is the GCS
job table's ``is_dead`` (the one Ray's own autoscaler reads); a failed query counts as alive.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

import ray

POLL_S = 1.0
KV_NAMESPACE = "rayconv"   # Ray's key-value store: the registry of kept groups (``cluster.across``)
_CODE: dict[str, str] = {}


def code_hash() -> str:
    """A hash of the rayconv code this process runs (every file of the imported package, by path and
    content) and of the versions of torch, torchvision and Ray installed: actors kept on the cluster
    serve only a command that runs the same code (a changed rayconv starts new actors)."""
    if "h" not in _CODE:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parents[1]
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        for package in ("torch", "torchvision", "ray"):
            try:
                h.update(f"{package}={metadata.version(package)}\0".encode())
            except metadata.PackageNotFoundError:
                h.update(f"{package}=-\0".encode())
        _CODE["h"] = h.hexdigest()[:16]
    return _CODE["h"]


def job_alive(job: str) -> bool:
    """Whether the Ray job ``job`` (hex id) runs: its driver has not ended. True when the GCS cannot
    be asked (the actor does not end on a hiccup)."""
    try:
        from ray._private.worker import global_worker

        jobs = global_worker.gcs_client.get_all_job_info(job_or_submission_id=job,
                                                         skip_submission_job_info_field=True,
                                                         skip_is_running_tasks_field=True, timeout=10)
    except Exception:  # noqa: BLE001 - unknown: alive
        return True
    for job_id, info in jobs.items():
        if job_id.hex() == job:
            return not info.is_dead
    return True


class Watch:
    """The watchdog of one detached actor (see the module docstring), in use by job ``job`` at first."""

    def __init__(self, job: str):
        self.lock = threading.Lock()
        self.job: Optional[str] = job
        self.key: Optional[str] = None       # while kept: what a claim must match (``pool.actors_key``)
        self.until = 0.0                     # while kept: when it ends unclaimed (monotonic)
        self.entry: Optional[str] = None     # while kept: its group's entry in the registry
        self.thread = threading.Thread(target=self._loop, name="rayconv-watchdog", daemon=True)
        self.thread.start()

    def keep(self, key: str, keep_s: float, entry: str) -> str:
        """Kept, for ``keep_s`` seconds, for a claim of ``key``; ``entry``: the group's registry entry.
        Returns this process's ``code_hash`` (the driver keeps the group only where it is its own)."""
        with self.lock:
            self.job, self.key, self.entry = None, key, entry
            self.until = time.monotonic() + keep_s
        return code_hash()

    def claim(self, key: str, job: str) -> bool:
        """In use by job ``job`` when kept for ``key`` and not yet ended: True once; False otherwise
        (claimed already, another key, or past its time)."""
        with self.lock:
            if self.job is not None or self.key != key or time.monotonic() >= self.until:
                return False
            self.job, self.key, self.entry = job, None, None
            return True

    def _loop(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self.lock:
                job, entry = self.job, self.entry
                expired = job is None and time.monotonic() >= self.until   # (no claim succeeds after)
            if expired:
                self._end(entry, "kept and not claimed within --keep-actors-s")
            elif job is not None and not job_alive(job):
                with self.lock:
                    if self.job != job:   # (kept meanwhile: the driver ended normally just now)
                        continue
                self._end(None, f"the driver using it (Ray job {job}) is gone")

    def _end(self, entry: Optional[str], why: str) -> None:
        logging.getLogger("rayconv").warning("rayconv: actor ends: %s", why)
        if entry is not None:
            try:
                from ray.experimental.internal_kv import _internal_kv_del

                _internal_kv_del(entry, namespace=KV_NAMESPACE)
            except Exception:  # noqa: BLE001 - gone already
                pass
        try:
            from ray.util.placement_group import get_current_placement_group, remove_placement_group

            pg = get_current_placement_group()
            if pg is not None:
                remove_placement_group(pg)   # (stops the group's other actors too)
        except Exception:  # noqa: BLE001 - removed already
            pass
        time.sleep(0.5)   # (the removal reaches the GCS before this process ends)
        os._exit(0)


def current_job() -> str:
    """The Ray job (hex id) this process is the driver of."""
    return ray.get_runtime_context().get_job_id()

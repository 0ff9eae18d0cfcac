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
(``cluster.across``'s registry of kept groups) and ends the process.

Whether a job is alive is told by its life marker (``mark_alive``): a placement group the job's driver
makes once, named ``rayconv-job/<job>`` and not detached, which Ray removes when the job ends (its
driver exited, was killed, or lost its node) as it removes every placement group a job owns. It holds one
byte of Ray's ``memory`` resource, so that it is placed at once and takes nothing a run needs; a lookup
that fails (the GCS not answering) counts as alive.
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


LIFE_PREFIX = "rayconv-job/"   # + a job's hex id: the name of its life marker (the module docstring)
_MARKERS: dict[tuple[str, str], object] = {}   # (cluster's GCS address, job) -> the job's life marker


def mark_alive() -> bool:
    """Make this driver's job's life marker (once per job; the module docstring), which ``job_alive``
    looks up: a driver makes it before it names its job to a watchdog or in the registry. False when Ray
    refuses it (such a driver keeps nothing on the cluster)."""
    from ray.util.placement_group import placement_group

    where = (ray.get_runtime_context().gcs_address, current_job())
    if where not in _MARKERS:
        try:
            _MARKERS[where] = placement_group([{"memory": 1}], name=f"{LIFE_PREFIX}{where[1]}")
        except Exception:  # noqa: BLE001 - refused: the caller keeps nothing on the cluster
            logging.getLogger("rayconv").info("rayconv: no life marker for job %s", where[1], exc_info=True)
            return False
    return True


def job_alive(job: str) -> bool:
    """Whether the Ray job ``job`` (hex id) runs: its driver has not ended (its life marker is there:
    the module docstring). True when Ray cannot be asked (the actor does not end on a hiccup) and for an
    empty id."""
    if not job or not ray.is_initialized():
        return True
    from ray.util import get_placement_group

    try:
        get_placement_group(f"{LIFE_PREFIX}{job}")
    except ValueError:   # (no placement group of that name: removed with its job)
        return False
    except Exception:  # noqa: BLE001 - unknown: alive
        return True
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

"""The Ray clusters running on this host, read from the process table (``/proc``).

Each Ray node on a host runs a raylet, whose command line names its cluster's GCS address
(``--gcs-address=HOST:PORT``, inside the worker command it is given: Ray's own command line searches
for it there too) and whose parent is the process that started the node: a driver whose ``ray.init``
started a local cluster (it ends with that driver), or, for ``ray start``, which exits, the process
that adopted it. Where there is no ``/proc`` (not Linux) nothing is found: ``gcs_addresses`` is empty
and ``started_by`` False.

``has_nvidia_gpu`` says whether a Ray node started on this host would have GPUs, without torch or NVML.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

PROC = "/proc"
GCS_FLAG = "--gcs-address="


def raylets(proc: str = PROC) -> list[tuple[int, str]]:
    """(parent process id, GCS address ``HOST:PORT``) of each raylet on this host, in process id order;
    processes that end while read, or that this user may not read, are left out."""
    found = []
    root = Path(proc)
    try:
        pids = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
    except OSError:
        return []
    for pid in pids:
        try:
            args = (root / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if not args or "raylet" not in os.path.basename(args[0]):
                continue
            stat = (root / str(pid) / "stat").read_text()
        except OSError:
            continue
        gcs = _flag(args)
        if gcs is not None:
            # (stat: "pid (comm) state ppid ...": comm may hold spaces and parentheses)
            found.append((int(stat.rpartition(")")[2].split()[1]), gcs))
    return found


def _flag(args: list[str]) -> Optional[str]:
    for arg in args:
        for word in arg.split(" "):
            if word.startswith(GCS_FLAG) and word[len(GCS_FLAG):] not in ("", "None"):
                return word[len(GCS_FLAG):]
    return None


def gcs_addresses(proc: str = PROC) -> set[str]:
    """The GCS addresses of the Ray clusters with a node on this host."""
    return {gcs for _, gcs in raylets(proc)}


def started_by(pid: int, gcs: Optional[str], proc: str = PROC) -> bool:
    """Whether process ``pid`` started a node of the cluster at ``gcs`` on this host (its raylet is that
    process's child): a local cluster that ``ray.init`` started in it, which ends with it."""
    return gcs is not None and any(parent == pid and address == gcs for parent, address in raylets(proc))


def has_nvidia_gpu(env: Optional[Mapping[str, str]] = None, proc: str = PROC,
                   dev: str = "/dev") -> bool:
    """Whether a Ray node started here by this process may count an NVIDIA GPU, by Ray's rule (the
    driver's device count, cut to the ids CUDA_VISIBLE_DEVICES lists where it is set) read without NVML
    or torch. False where CUDA_VISIBLE_DEVICES (of ``env``, default os.environ) lists none ("",
    "NoDevFiles", or first "-1", after which CUDA reads no more), or where the driver lists no GPU (no
    entry in ``proc``/driver/nvidia/gpus/) and no device file ``dev``/nvidia0, nvidia1, ... exists; else
    True (a GPU may be there: the cluster started is asked, ``connect.available_devices``)."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (visible.strip() in ("", "NoDevFiles")
                                or visible.split(",")[0].strip() == "-1"):
        return False
    try:
        listed = any((Path(proc) / "driver" / "nvidia" / "gpus").iterdir())
    except OSError:
        listed = False
    try:
        files = any(f.name[len("nvidia"):].isdigit() for f in Path(dev).glob("nvidia[0-9]*"))
    except OSError:
        files = False
    return listed or files

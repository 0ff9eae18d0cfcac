"""A Ray head of a test module's own: ``ray start --head --block``, every port a free one, its own temp
folder, ended by its own process group, so that the host's other Ray instances live on.

A port is picked free and closed, and ``ray start`` binds it a moment later; another process of a busy
machine may take it in between. ``ray start`` then exits at once, and ``own_head`` starts it again on
newly picked ports (``TRIES`` times in all) before it fails with the last log."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

# Every port `ray start --head` would otherwise take at a fixed default (GCS 6379, dashboard 8265, its
# agent 52365, Ray client 10001, ...) or pick at random among what another Ray instance may then take.
PORT_FLAGS = ("--port", "--dashboard-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
              "--metrics-export-port", "--runtime-env-agent-port", "--ray-client-server-port",
              "--node-manager-port", "--object-manager-port")
TRIES = 3
START_S = 120.0   # seconds a head has to write its ray_current_cluster (a loaded 2-core machine)


def free_port(taken: range = range(0), chosen: tuple[int, ...] = ()) -> int:
    """A port free now, outside ``taken`` and not among ``chosen``."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken and port not in chosen:
            return port


def _ports(worker_ports: int) -> tuple[dict[str, int], list[str]]:
    """(flag -> port for ``PORT_FLAGS``, the worker-port flags): with ``worker_ports`` > 0 the workers get
    a range of that many ports of their own, which no other flag's port falls in."""
    low, extra = 0, []
    if worker_ports:
        low = free_port() // 100 * 100 % 50000 + 10000
        extra = ["--min-worker-port", str(low), "--max-worker-port", str(low + worker_ports - 1)]
    ports: dict[str, int] = {}
    for flag in PORT_FLAGS:
        ports[flag] = free_port(range(low, low + worker_ports), tuple(ports.values()))
    return ports, extra


@contextlib.contextmanager
def own_head(*flags: str, env: Optional[dict[str, str]] = None, worker_ports: int = 0,
             prefix: str = "rc-") -> Iterator[dict[str, int]]:
    """Run a Ray head with ``flags`` (e.g. ``--num-cpus 2 --include-dashboard false``) and the
    environment ``env`` adds to this process's, until the block ends; yields its ports (flag -> port;
    its address is ``127.0.0.1:ports["--port"]``). A head that exits while it starts is started again on
    new ports; after ``TRIES`` such exits, or ``START_S`` seconds, AssertionError with its log."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # on SIGTERM the head stops its processes at once instead of first draining the node for up to 30 s
    # (a wait for work to move elsewhere: there is none to move at the module's end)
    full_env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **(env or {})}
    for attempt in range(1, TRIES + 1):
        ports, extra = _ports(worker_ports)
        temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")   # (short: Ray's socket paths are limited)
        log = Path(temp_dir) / "ray-start.log"
        cmd = [ray_cli, "start", "--head", "--block", "--temp-dir", temp_dir, *flags, *extra,
               *[f"{flag}={port}" for flag, port in ports.items()]]
        with log.open("w") as f:
            head = subprocess.Popen(cmd, env=full_env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        deadline = time.monotonic() + START_S
        try:
            while not (Path(temp_dir) / "ray_current_cluster").exists():   # written once the head is up
                if head.poll() is not None:
                    break
                assert time.monotonic() < deadline, f"the Ray head did not start within {START_S:.0f} s"
                time.sleep(0.5)
            else:
                yield ports
                return
            assert attempt < TRIES, f"ray start exited {head.returncode} {TRIES} times; the last log:\n" \
                                    f"{log.read_text()[-3000:]}"
        finally:
            _end(head, temp_dir)


def _end(head: subprocess.Popen, temp_dir: str) -> None:
    """Stop the head's whole process group (SIGTERM, then SIGKILL after 60 s) and remove its temp folder."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)   # (whatever is left of it: a shutdown that hung)
    shutil.rmtree(temp_dir, ignore_errors=True)

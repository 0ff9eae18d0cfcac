"""Shared fixtures: a real local Ray cluster on CPU (gloo process groups inside the actors)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import ray

# Actors must not oversubscribe the 2 cores of CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def local_ray(num_cpus: int, **kw):
    """Start a fresh local Ray cluster (no dashboard unless asked), yield, shut it down."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=num_cpus, **{"include_dashboard": False, "namespace": "rayconv", "log_to_driver": False,
                                   "configure_logging": True, "logging_level": "WARNING", **kw})
    yield
    ray.shutdown()


_SHARED: dict[str, object] = {"gcs": None}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with 4 logical CPUs (enough for dp=4 on a 2-core machine), no dashboard.

    One cluster serves every module that asks for it in turn (starting one costs seconds of the 2
    cores): a module reuses it when it is still connected and all 4 CPUs are free, and starts a fresh
    one otherwise (after a module that ran its own cluster, or one that left something holding CPUs).
    ``pytest_sessionfinish`` shuts it down."""
    if ray.is_initialized() and _SHARED["gcs"] == ray.get_runtime_context().gcs_address \
            and ray.available_resources().get("CPU") == 4:
        yield
        return
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, namespace="rayconv", log_to_driver=False,
             configure_logging=True, logging_level="WARNING")
    _SHARED["gcs"] = ray.get_runtime_context().gcs_address
    yield


@pytest.fixture
def silent_address():
    """``host:port`` of a loopback listener that records every connection: a run that reaches for its
    cluster contacts it (and is then refused, as no Ray answers there)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    contacts: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                contacts.append(listener.accept()[0])
            except OSError:  # closed below
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}", contacts
    listener.close()
    for c in contacts:
        c.close()


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    """Leave nothing for interpreter shutdown to tear down: no Ray connection, no loader workers."""
    import gc

    if ray.is_initialized():
        ray.shutdown()
    gc.collect()
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with pytest's own exit status, skipping native libraries' exit-time destructors.

    Workaround, root cause not found: on 2 of 4 clean-clone CI runs every test passed and the
    interpreter then died of SIGSEGV during its final teardown (after faulthandler is disabled, so no
    Python stack: a native destructor). The status returned is exactly pytest's (5 when no tests ran)."""
    if _EXIT_STATUS:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])

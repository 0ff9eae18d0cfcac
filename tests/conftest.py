"""Shared fixtures: a real local Ray cluster on CPU (gloo process groups inside the actors)."""

from __future__ import annotations

import os

import pytest
import ray

# Actors must not oversubscribe the 2 cores of CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with 4 logical CPUs (enough for dp=4 on a 2-core machine), no dashboard."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, namespace="rayconv", log_to_driver=False,
             configure_logging=True, logging_level="WARNING")
    yield
    ray.shutdown()

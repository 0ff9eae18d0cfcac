"""Whether a Ray job runs, as a kept actor's watchdog and a command's sweep ask it (``cluster.watch``): its
driver's life marker is there while the driver runs and gone once it was killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import ray

from rayconv.cluster import watch

REPO = Path(__file__).resolve().parents[2]
DRIVER = """
import sys, time
import ray
from rayconv.cluster import watch
ray.init(address=sys.argv[1], namespace="rayconv", log_to_driver=False, logging_level="ERROR")
assert watch.mark_alive() and watch.mark_alive()   # (once per job)
print(watch.current_job(), flush=True)
time.sleep(600)
"""


def test_a_job_runs_until_its_driver_is_killed(ray_cluster):
    assert watch.mark_alive() and watch.job_alive(watch.current_job())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, ray.get_runtime_context().gcs_address],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        job = proc.stdout.readline().strip()
        assert job and job != watch.current_job() and watch.job_alive(job)
    finally:
        proc.kill()   # SIGKILL: the driver does nothing more
        proc.wait()
    deadline = time.monotonic() + 30
    while watch.job_alive(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not watch.job_alive(job)
    assert watch.job_alive(watch.current_job()) and watch.job_alive("")   # (no job named: alive)

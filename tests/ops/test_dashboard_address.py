"""The dashboard a run's header names is the attached cluster's, in every process of it: a Tune trial's
run (a worker process) names the one the search's process was told by Ray, never its raylet's default,
which is another Ray's where the default port was taken; an actor told none names none
(``cluster.connect.dashboard_url``); a dashboard Ray could not start is named as not running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A local cluster whose dashboard finds the default port (8265) taken: held here when free, as another
# user's Ray would hold it; Ray then moves its dashboard to the next free port.
SCRIPT = """
import json, socket, sys
from pathlib import Path
held = socket.socket()
try:
    held.bind(("0.0.0.0", 8265)); held.listen()
except OSError:
    pass   # (taken already: the same case)
import ray
from rayconv import tune
from rayconv.cluster.connect import dashboard_url
ray.init(num_cpus=2, include_dashboard=True, log_to_driver=False, configure_logging=True,
         logging_level="ERROR")

@ray.remote(num_cpus=0)
class Worker:
    def url(self):
        return dashboard_url()

out = Path(sys.argv[1])
tune.search({"seed": {"grid": [0]}}, {"dp": 1, "steps": 2, "eval_every": 2, "global_batch_size": 32,
            "out": str(out), "metrics": False, "progress": False}, scheduler="fifo", log=lambda line: None)
trial = [x for x in (out / "logs" / "trial-0.log").read_text().splitlines() if "Ray dashboard:" in x]
print(json.dumps({"driver": dashboard_url(), "worker": ray.get(Worker.remote().url.remote()),
                  "trial": trial}))
"""


@pytest.mark.slow
def test_a_trials_run_names_the_clusters_dashboard():
    temp_dir = tempfile.mkdtemp(prefix="rc-dash-", dir="/tmp")   # (short: Ray's socket paths are limited)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": temp_dir}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, f"{temp_dir}/search"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    urls = json.loads(proc.stdout.strip().splitlines()[-1])
    assert urls["driver"] and not urls["driver"].endswith(":8265"), urls
    assert urls["trial"] == [f"rayconv: Ray dashboard: {urls['driver']}"], urls
    assert urls["worker"] is None, urls   # (told none: its raylet's address would be another Ray's)


@pytest.mark.slow
def test_a_dashboard_ray_could_not_start_is_named_in_the_header(tmp_path):
    """A local cluster whose dashboard does not answer within Ray's start-up wait (a loaded host; here a
    wait of 0 s): Ray logs its error and the run goes on, its header saying that no dashboard runs."""
    temp_dir = tempfile.mkdtemp(prefix="rc-dash-", dir="/tmp")   # (short: Ray's socket paths are limited)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": temp_dir,
           "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "0", "RAYCONV_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "rayconv.run", "--device", "cpu", "--dp", "1", "--steps",
                           "2", "--eval-every", "2", "--no-progress", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("rayconv: Ray dashboard:")]
    assert lines == ["rayconv: Ray dashboard: not running (Ray could not start it; the run goes on)"], \
        proc.stdout[-3000:]

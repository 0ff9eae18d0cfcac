"""The Ray dashboard: a real local Ray head with its dashboard (bound to 127.0.0.1) shows the run's
named actors and their states through its HTTP state API, the rayconv gauges reach Ray's metrics
(the dashboard's Metrics view and Prometheus read them), and ``ray job submit`` runs the CLI.

This module starts its own Ray (with the dashboard) and shuts it down at the end; other modules'
``ray_cluster`` fixture starts a fresh one after it."""

from __future__ import annotations

import json
import shutil
import tempfile
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray

from rayconv.config import Config
from rayconv.driver import fit

REPO = Path(__file__).resolve().parents[1]
# (gauge, role) pairs a dp=2 run exports (dp1 reports the loss too: every replica's last stage does)
WANT = {("images_per_s", "dp0"), ("images_per_s", "dp1"), ("images_per_s", "driver"),
        ("step_ms", "dp0"), ("loss", "dp1"), ("loss", "driver"), ("step", "driver")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if body.startswith("{") else body


@pytest.fixture(scope="module")
def dashboard():
    """A local Ray head with the dashboard on 127.0.0.1:<free port>; metrics reported every 0.5 s."""
    if ray.is_initialized():
        ray.shutdown()
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "500"  # inherited by the raylet and workers
    port = free_port()
    # A session folder of its own: the job server finds "its" cluster through <temp dir>/ray_current_cluster,
    # which in the shared /tmp/ray names the newest cluster on the machine, maybe another one.
    temp_dir = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
    ctx = ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
                   namespace="rayconv", log_to_driver=False, configure_logging=True, logging_level="WARNING",
                   _temp_dir=temp_dir)
    try:
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "dashboard_url": ctx.dashboard_url,
               "metrics_port": ray._private.worker.global_worker.node.metrics_export_port}
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if old is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = old


def rayconv_actors(base: str, run: str) -> dict[str, str]:
    """name -> state of the run's actors, from the dashboard's HTTP state API."""
    res = get(f"{base}/api/v0/actors?limit=10000&detail=false")
    assert res["result"] is True, res
    return {a["name"]: a["state"] for a in res["data"]["result"]["result"]
            if (a.get("name") or "").startswith(f"rayconv/{run}/")}


def gauge_lines(metrics_port: int, run: str) -> list[str]:
    text = get(f"http://127.0.0.1:{metrics_port}/metrics")
    return [line for line in text.splitlines() if line.startswith("ray_rayconv_") and f'run="{run}"' in line]


def test_dashboard_is_bound_to_localhost(dashboard):
    assert dashboard["dashboard_url"].startswith("127.0.0.1:")
    assert get(f"{dashboard['url']}/api/version")["ray_version"] == ray.__version__
    ip = ray.util.get_node_ip_address()
    if ip.startswith("127."):
        pytest.skip("the node has no other address to try")
    with pytest.raises(OSError):  # not reachable on the node's own address
        socket.create_connection((ip, dashboard["port"]), timeout=3).close()


def test_actors_and_gauges_in_the_dashboard(dashboard, tmp_path):
    out = tmp_path / "dash"
    run = out.name
    seen: dict[str, object] = {}

    def look(gang, step):
        if step != 2:
            return
        seen["actors"] = rayconv_actors(dashboard["url"], run)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lines = gauge_lines(dashboard["metrics_port"], run)
            have = {(line.split("{")[0][len("ray_rayconv_"):], role) for line in lines
                    for role in ("dp0", "dp1", "driver") if f'role="{role}"' in line}
            if WANT <= have:
                break
            time.sleep(0.5)
        seen["gauges"] = have
        seen["lines"] = lines

    cfg = Config(model="convnet", data="digits", dp=2, global_batch_size=64, steps=4, device="cpu",
                 progress=False, out=str(out), loader_workers=0).validate()
    fit(cfg, log=lambda *_: None, on_step=look)
    assert seen["actors"] == {f"rayconv/{run}/dp0": "ALIVE", f"rayconv/{run}/dp1": "ALIVE"}, seen["actors"]
    assert WANT <= seen["gauges"], seen["lines"]
    loss = [float(line.rsplit(" ", 1)[1]) for line in seen["lines"]
            if line.startswith("ray_rayconv_loss{") and 'role="driver"' in line]
    assert loss and 0 < loss[0] < 10
    # After the run: the same actors, dead (killed by the driver).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = rayconv_actors(dashboard["url"], run)
        if set(states.values()) == {"DEAD"}:
            break
        time.sleep(0.5)
    assert states == {f"rayconv/{run}/dp0": "DEAD", f"rayconv/{run}/dp1": "DEAD"}, states


def test_ray_job_submit(dashboard, tmp_path):
    """``ray job submit -- python -m rayconv.run ...`` against the dashboard's job API."""
    out = tmp_path / "job"
    ray_cli = Path(sys.executable).with_name("ray")
    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}}
    cmd = [str(ray_cli), "job", "submit", "--address", dashboard["url"], "--runtime-env-json", json.dumps(runtime_env),
           "--", sys.executable, "-m", "rayconv.run", "--steps", "3", "--dp", "2", "--device", "cpu",
           "--no-progress", "--out", str(out)]
    deadline = time.monotonic() + 90
    while True:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        # The dashboard's job agent starts after the dashboard (slowly on a loaded machine): until it
        # is up, the submission is refused before the job runs, so it can be retried.
        if "No available agent" not in proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["layout"]["dp"] == 2
    # It ran on this cluster: its placement group is in this cluster's table.
    assert any(pg["name"] == f"rayconv/{out.name}" for pg in ray.util.placement_group_table().values())

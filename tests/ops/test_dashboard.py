"""The Ray dashboard: a real Ray head (``ray start --head``) with its dashboard (bound to 127.0.0.1)
shows the run's named actors and their states through its HTTP state API and its web page, the
rayconv gauges reach Ray's metrics (the dashboard's Metrics view and Prometheus read them), ``ray job
submit`` runs the CLI, and two runs whose output folders share a name run at once on it.

This module starts its own Ray head, every port of it a free one (other Ray instances may run on the
same host: the dashboard agent's default port 52365 would then be taken), and stops it at the end;
other modules' ``ray_cluster`` fixture starts a fresh one after it."""

from __future__ import annotations

import json
import shutil
import signal
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray

import rayconv

from support.helpers import wait_until
from support.ray_head import own_head
from rayconv.config import Config
from rayconv.driver.job import train_run

pytestmark = pytest.mark.slow     # (every test needs its own cluster with the dashboard)

REPO = Path(__file__).resolve().parents[2]
# (gauge, role) pairs a dp=2 run exports (dp1 reports the loss too: every replica's last stage does)
WANT = {("images_per_s", "dp0"), ("images_per_s", "dp1"), ("images_per_s", "driver"),
        ("step_ms", "dp0"), ("loss", "dp1"), ("loss", "driver"), ("step", "driver")}


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if body.startswith("{") else body


@pytest.fixture(scope="module")
def dashboard():
    """``ray start --head`` with the dashboard on 127.0.0.1, every port a free one; metrics reported
    every 0.5 s. This process connects to it as a driver."""
    if ray.is_initialized():
        ray.shutdown()
    env = {"RAY_metrics_report_interval_ms": "500",  # inherited by the raylet and workers
           # the dashboard's modules start as processes: on a loaded 2-core machine 30 s (the default) is
           # short
           "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "180"}
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "500"  # this process's gauges (the driver's) too
    try:
        # (a Ray temp folder of its own: the job server finds "its" cluster through
        # <temp dir>/ray_current_cluster,
        # which in the shared /tmp/ray names the newest cluster on the machine, maybe another one)
        with own_head("--num-cpus", "4", "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                      env=env) as ports:
            address = f"127.0.0.1:{ports['--port']}"
            ctx = ray.init(address=address, namespace="rayconv", log_to_driver=False, configure_logging=True,
                           logging_level="WARNING")
            try:
                port = ports["--dashboard-port"]
                yield {"url": f"http://127.0.0.1:{port}", "port": port, "dashboard_url": ctx.dashboard_url,
                       "metrics_port": ports["--metrics-export-port"], "address": address}
            finally:
                ray.shutdown()
    finally:
        if old is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = old


def rayconv_actors(base: str, run: str) -> dict[str, str]:
    """name -> state of the actors whose run name starts with ``run``, from the dashboard's HTTP state API."""
    res = get(f"{base}/api/v0/actors?limit=10000&detail=false")
    assert res["result"] is True, res
    return {a["name"]: a["state"] for a in res["data"]["result"]["result"]
            if (a.get("name") or "").startswith(f"rayconv/{run}")}


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


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def actors_page_dom(url: str) -> str:
    """The dashboard's Actors page at ``url`` as a real headless browser renders it (its DOM)."""
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--virtual-time-budget=20000", "--dump-dom", f"{url}/#/actors"],
                          capture_output=True, text=True, timeout=120).stdout


# The Actors page as rendered during a dp=2 run, and that run's name: the gauges test's run records
# them (at its step 1) for the page test, which runs its own when run alone.
_PAGE: dict[str, str] = {}


def record_page(url: str) -> None:
    """Put the Actors page's DOM (or the browser's error) into ``_PAGE``, if a chromium is there."""
    if chromium() is None:
        return
    try:
        _PAGE["dom"] = actors_page_dom(url)
    except (subprocess.SubprocessError, OSError) as e:
        _PAGE["error"] = repr(e)


def test_actors_and_gauges_in_the_dashboard(dashboard, tmp_path):
    out = tmp_path / "dash"
    seen: dict[str, object] = {}

    def look(actor_group, step):
        if step == 1:
            record_page(dashboard["url"])
        if step != 2:
            return
        seen["actors"] = rayconv_actors(dashboard["url"], f"{out.name}-")
        run = seen["run"] = next(iter(seen["actors"])).split("/")[1]
        deadline = time.monotonic() + 60
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
    run = _PAGE["run"] = train_run(cfg, log=lambda *_: None, on_step=look)["run_name"]
    assert seen["run"] == run and run.startswith(f"{out.name}-")
    assert seen["actors"] == {f"rayconv/{run}/dp0": "ALIVE", f"rayconv/{run}/dp1": "ALIVE"}, seen["actors"]
    assert WANT <= seen["gauges"], seen["lines"]
    loss = [float(line.rsplit(" ", 1)[1]) for line in seen["lines"]
            if line.startswith("ray_rayconv_loss{") and 'role="driver"' in line]
    assert loss and 0 < loss[0] < 10
    # After the run: the same actors, kept for this process's next run (--keep-actors-s) until
    # rayconv.release_actors() stops them; then dead.
    assert rayconv_actors(dashboard["url"], f"{run}/") == seen["actors"]
    rayconv.release_actors()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = rayconv_actors(dashboard["url"], f"{run}/")
        if set(states.values()) == {"DEAD"}:
            break
        time.sleep(0.5)
    assert states == {f"rayconv/{run}/dp0": "DEAD", f"rayconv/{run}/dp1": "DEAD"}, states


def test_ray_job_submit(dashboard, tmp_path):
    """``ray job submit -- python -m rayconv.run ...`` against the dashboard's job API."""
    out = tmp_path / "job"
    ray_cli = Path(sys.executable).with_name("ray")
    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}}
    cmd = [str(ray_cli), "job", "submit", "--address", dashboard["url"], "--runtime-env-json",
           json.dumps(runtime_env), "--", sys.executable, "-m", "rayconv.run", "--steps", "3", "--dp", "2",
           "--device", "cpu", "--no-progress", "--out", str(out)]
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
    # The header names the job and the output folder in full (a relative --out is refused under a job:
    # tests/unit/test_run_folder.py).
    assert "; Ray job raysubmit_" in proc.stdout and f"3 steps -> {out};" in proc.stdout, proc.stdout[-3000:]
    # It ran on this cluster: its placement group is in this cluster's table.
    assert any(pg["name"] == f"rayconv/{summary['run_name']}"
               for pg in ray.util.placement_group_table().values())


def test_two_runs_with_the_same_folder_name_at_once(dashboard, tmp_path):
    """``--out /tmp/one/run`` and ``--out /tmp/two/run`` on one cluster at once: each run has its own
    name on the cluster (placement group, actors, gauges), said on the console and in summary.json.
    The first, stopped by SIGTERM, keeps its folder (metrics, summary: interrupted)."""
    one = tmp_path / "one" / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "rayconv.run", "--address", dashboard["address"], "--steps", "100000", "--dp",
         "1", "--device", "cpu", "--global-batch-size", "32", "--no-progress", "--no-metrics", "--out",
         str(one)],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(first,
                   lambda: any(s == "ALIVE" for s in rayconv_actors(dashboard["url"], "run-").values()),
                   "the first run's actors did not start")
        lines: list[str] = []
        cfg = Config(model="convnet", data="digits", dp=1, global_batch_size=32, steps=2, device="cpu",
                     progress=False, metrics=False, out=str(tmp_path / "two" / "run"),
                     loader_workers=0).validate()
        second = train_run(cfg, log=lines.append)["run_name"]
        assert first.poll() is None, "the first run did not overlap the second"
        # SIGTERM (as `ray job stop` or a scheduler sends it) once the first run wrote its metrics (an
        # evaluation: 45 steps), without --checkpoint-every: its folder stays, saying it was interrupted.
        wait_until(first, lambda: (one / "metrics.parquet").exists(), "the first run's first evaluation")
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, err
    assert "interrupted by SIGTERM" in err and "--checkpoint-every N" in err and "removed" not in err, err
    summary = json.loads((one / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] >= 45, summary
    assert (one / "config.json").is_file() and not (one / "checkpoints").exists()
    name = out.split("Ray run name ")[1].split()[0]
    port = dashboard["address"].rsplit(":", 1)[1]   # (the GCS gives the node's IP for the host)
    for printed in (out.splitlines(), lines):   # (a run of its own command line, and this process's fit)
        assert any(x.startswith("rayconv: Ray: attached to the cluster at ") and f":{port} (" in x
                   for x in printed), printed[:5]
        assert f"rayconv: Ray dashboard: {dashboard['url']}" in printed, printed[:5]   # (where to watch it)
    assert name != second and name.startswith("run-") and second.startswith("run-"), (name, second)
    assert f"Ray run name {second}" in lines[0]
    pgs = {pg["name"] for pg in ray.util.placement_group_table().values()}
    assert {f"rayconv/{name}", f"rayconv/{second}"} <= pgs


@pytest.mark.skipif(chromium() is None, reason="needs a headless chromium (apt-get install chromium)")
def test_actors_on_the_dashboard_page(dashboard, tmp_path):
    """The dashboard's Actors page, rendered by a real headless browser while a run goes, lists its actors."""
    if "run" not in _PAGE:
        cfg = Config(model="convnet", data="digits", dp=2, global_batch_size=64, steps=3, device="cpu",
                     progress=False, metrics=False, out=str(tmp_path / "page"), loader_workers=0).validate()
        _PAGE["run"] = train_run(
            cfg, log=lambda *_: None,
            on_step=lambda actor_group, step: step == 1 and record_page(dashboard["url"]))["run_name"]
    assert "error" not in _PAGE, _PAGE["error"]
    run, dom = _PAGE["run"], _PAGE["dom"]
    assert f"rayconv/{run}/dp0" in dom and f"rayconv/{run}/dp1" in dom, dom[-3000:]

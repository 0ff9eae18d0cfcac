"""The Ray clusters on this host, read from a process table (``cluster.host``) laid out as Linux's
``/proc``: a raylet's command line and its parent (the real table: ``tests/actors/test_cli_address``)."""

from __future__ import annotations

from rayconv.cluster import host

WORKER = ("/venv/bin/python /venv/ray/workers/default_worker.py --node-ip-address=10.0.0.5 "
          "--redis-address=None --gcs-address={gcs} --temp-dir=/tmp/ray RAY_WORKER_DYNAMIC_OPTION")


def process(proc, pid: int, ppid: int, args: list[str], comm: str = "raylet") -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes("\0".join(args).encode() + b"\0")
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")


def test_raylets_name_their_clusters_and_the_process_that_started_them(tmp_path):
    proc = tmp_path / "proc"
    raylet = "/venv/ray/core/src/ray/raylet/raylet"
    process(proc, 40, 7, [raylet, "--node_manager_port=0",
                          f"--python_worker_command={WORKER.format(gcs='10.0.0.5:6379')}"])
    process(proc, 41, 1, [raylet, f"--python_worker_command={WORKER.format(gcs='10.0.0.5:41234')}"],
            comm="raylet (x)")   # (a name with a space and parentheses)
    process(proc, 42, 7, ["/venv/ray/core/src/ray/gcs/gcs_server", "--gcs_server_port=6379"],
            comm="gcs_server")
    process(proc, 43, 7, ["python", "--gcs-address=10.0.0.5:9999"], comm="python")   # (not a raylet)
    process(proc, 44, 7, [raylet, "--gcs-address=None"])                              # (no address)
    (proc / "self").mkdir()
    assert host.raylets(str(proc)) == [(7, "10.0.0.5:6379"), (1, "10.0.0.5:41234")]
    assert host.gcs_addresses(str(proc)) == {"10.0.0.5:6379", "10.0.0.5:41234"}
    assert host.started_by(7, "10.0.0.5:6379", str(proc))
    assert not host.started_by(7, "10.0.0.5:41234", str(proc))
    assert not host.started_by(8, "10.0.0.5:6379", str(proc))
    assert host.raylets(str(tmp_path / "none")) == [] and not host.started_by(7, None, str(proc))


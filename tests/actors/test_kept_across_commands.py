"""Actors kept on a running cluster by one command (``python -m rayconv.run``) serve the next command
that needs the same actors (``--keep-actors-s``, ``cluster.across``); unclaimed they end after
``--keep-actors-s`` seconds, and a command killed mid-run leaves neither actor nor placement group
(each actor's watchdog, ``cluster.watch``). A torchvision model is checked by the kept actors, which
imported torchvision, for a command whose driver has not (``resolve.WarmCheck``) and whose settings
passed the model's checks before (``driver.passed``); a model that cannot take the data is refused by
the driver before any actor starts.

The module starts its own Ray head (``ray start --head --block``, every port a free one, its own temp
folder, 2 CPUs) and ends it by its process group, so that no other Ray of the host is touched."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from support.ray_head import own_head

pytestmark = pytest.mark.slow   # (each command is a fresh process: seconds)

REPO = Path(__file__).resolve().parents[2]
RUN = ["--data", "digits", "--model", "convnet", "--dp", "1", "--device", "cpu", "--steps", "3",
       "--eval-every", "3", "--global-batch-size", "32", "--no-progress", "--loader-workers", "0"]


@pytest.fixture(scope="module")
def head():
    """The address of a Ray head of this module's own (see the module docstring); this process is
    connected to it (to look at its actors and placement groups)."""
    if ray.is_initialized():
        ray.shutdown()
    with own_head("--num-cpus", "2", "--include-dashboard", "false", worker_ports=100,
                  prefix="rck-") as ports:
        address = f"127.0.0.1:{ports['--port']}"
        ray.init(address=address, namespace="rayconv", log_to_driver=False, configure_logging=True,
                 logging_level="WARNING")
        try:
            yield address
        finally:
            ray.shutdown()


def _command(address: str, out: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "rayconv.run", "--address", address, *RUN, "--out",
                             str(out), *flags],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out
    return out


def _alive(run_name: str) -> list[str]:
    """The live actors named after run ``run_name`` (named actors of the namespace ``rayconv``)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "rayconv" and a["name"].startswith(f"rayconv/{run_name}/")]
    live = []
    for name in names:
        try:
            ray.get_actor(name, namespace="rayconv")
            live.append(name)
        except ValueError:
            pass
    return live


def _pg_states(run_name: str) -> list[str]:
    return [pg["state"] for pg in ray.util.placement_group_table().values()
            if pg["name"] == f"rayconv/{run_name}"]


def _gone(run_name: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(run_name) or any(s != "REMOVED" for s in _pg_states(run_name)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _refused(proc: subprocess.Popen) -> None:
    """``proc`` ended with exit status 2 and one line naming ``--model vit_b_16``, no traceback."""
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    last = out.strip().splitlines()[-1]
    assert "--model vit_b_16" in last and "Traceback" not in out, out


def test_the_next_command_reuses_the_actors_which_check_a_torchvision_model_and_unclaimed_they_end(
        head, tmp_path):
    tv = ("--model", "resnet18", "--steps", "2", "--eval-every", "2")   # (digits: 8x8 images)
    # Settings whose model checks passed on this machine (``driver.passed``; here in this process, which
    # shares the commands' cache folder) start their actors first, and an actor checks the model.
    from rayconv.driver.resolve import check_before_ray
    from rayconv.run import parse_command_line

    check_before_ray(parse_command_line([*RUN, *tv]), None)
    first = _finish(_command(head, tmp_path / "a", *tv))
    a = _summary(tmp_path / "a")
    assert "kept on the cluster" not in first
    assert "rayconv: 1 actors stay on the cluster for 60 s, for the next command that needs them" in first
    assert len(_alive(a["run_name"])) == 1 and _pg_states(a["run_name"]) == ["CREATED"]   # (kept, 60 s)
    assert a["startup"]["model_check"] == "actor" and "process_started" in a["startup"]["actor_process"]
    phases = list(a["startup"]["phases"])
    # (the actor's part named)
    assert phases.index("imports") < phases.index("model_checked") < phases.index("data")
    second = _finish(_command(head, tmp_path / "b", *tv, "--keep-actors-s", "3"))
    b = _summary(tmp_path / "b")
    assert "rayconv: 1 actors kept on the cluster by a previous command, reused (--keep-actors-s)" in second
    # (its address where Ray's command line would not find this head by itself: other Rays run here)
    listed = rf'\(`(RAY_ADDRESS=\S+:{head.rpartition(":")[2]} )?ray list actors --filter "name=rayconv/' \
        rf'{a["run_name"]}/dp0"`\)'
    assert re.search(listed, second), second
    assert "renewed" in b["startup"]["actor_process"] \
        and "process_started" not in b["startup"]["actor_process"]
    assert b["startup"]["model_check"] == "kept actor" and b["steps_done"] == 2 and b["status"] == "finished"
    # The same actors, kept again (now for 3 s: said by the command, as on a loaded machine they may end
    # before this process could look at them)
    assert "rayconv: 1 actors stay on the cluster for 3 s, for the next command that needs them" in second
    print(f"to step 0: first command {a['startup']['phases']['first_step']:.2f} s, "
          f"second {b['startup']['phases']['first_step']:.2f} s")
    # (vit_b_16: a transformer made for 224 px) refused by the driver before any actor starts: no output
    # folder, no actor of its own, and the kept actors unclaimed: they end after --keep-actors-s (3 s, the
    # watchdog polls every second), their placement group removed
    _refused(_command(head, tmp_path / "c", *tv, "--model", "vit_b_16"))
    assert not _run_names(tmp_path / "c") and not (tmp_path / "c").exists()
    assert _gone(a["run_name"], within_s=15) and _gone(b["run_name"], within_s=15)


def test_a_killed_command_leaves_no_actor_nor_placement_group(head, tmp_path):
    proc = _command(head, tmp_path / "k", "--steps", "100000", "--eval-every", "100000", "--log-every", "1",
                    "--progress")
    deadline = time.monotonic() + 120
    lines = []
    while not any("step 0 done" in line for line in lines):   # (training: the actors are in use)
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        lines.append(proc.stdout.readline())
    run_name = json.loads((tmp_path / "k" / "config.json").read_text()).get("run_name") \
        or _run_name_of(tmp_path / "k")
    assert _alive(run_name)
    proc.kill()   # SIGKILL: nothing of the driver's runs
    proc.wait()
    assert _gone(run_name, within_s=20)


def _run_names(out: Path, within_s: float = 15) -> set[str]:
    """The run names of live actors of runs whose output folder is named as ``out`` (none: once those
    stopping are gone, within ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        names = {a["name"].split("/")[1] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"rayconv/{out.name}-")}
        if not any(_alive(n) for n in names) or time.monotonic() > deadline:
            return {n for n in names if _alive(n)}
        time.sleep(0.5)


def _run_name_of(out: Path) -> str:
    names = _run_names(out, within_s=0)
    assert len(names) == 1, names
    return names.pop()

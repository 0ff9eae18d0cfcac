"""CPU seconds by kind of process while a command runs: where a test run's cores go.

    python benchmarks/suite_cpu.py [--every-s 0.25] -- python -m pytest -q tests/actors/test_data_parallel.py

Runs the command, reads /proc every ``--every-s`` seconds meanwhile, and prints, per kind of process
the command started (rayconv's actors, other Ray workers, Ray's own processes, the test processes,
commands the tests start: every process whose environment carries the token this script gives the
command, so Ray's daemons count and other jobs on the machine do not), how many there were and the CPU
seconds (user + system, /proc/PID/stat) each had used when last seen; then the command's wall time and
the share of the cores busy. A Ray worker's kind is read from the titles Ray gives it over its life
(``ray::IDLE``, then ``ray::<actor name>:Actor.<method>``). A process shorter than one interval is
missed, and a process's last interval is not counted. Linux only. Exit status: the command's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict

HZ = os.sysconf("SC_CLK_TCK")
TOKEN = "SUITE_CPU_RUN"   # the environment variable that marks the command's processes


def _read(pid: str) -> tuple[int, float, str]:
    """(start time in clock ticks since boot, CPU seconds, command line) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rfind(")") + 2:].split()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / HZ, cmd


def kind(titles: list[str]) -> str:
    """The kind of a process from the command lines it showed over its life."""
    text = " ".join(titles)
    if "default_worker.py" in text or "ray::" in text:
        if any(":Actor." in t or t.startswith("ray::Actor") for t in titles):
            return "rayconv actor (Ray worker)"
        named = [t.split()[0] for t in titles if t.startswith("ray::") and "IDLE" not in t]
        return f"Ray worker: {named[0].split(':')[-1][:40]}" if named else "Ray worker, never given work"
    for needle, name in (("ray-dashboard-", "Ray: dashboard modules (processes of their own)"),
                         ("gcs_server", "Ray: GCS"), ("raylet", "Ray: raylet"),
                         ("dashboard.py", "Ray: dashboard"), ("dashboard/agent.py", "Ray: dashboard agent"),
                         ("runtime_env", "Ray: runtime env agent"), ("log_monitor", "Ray: log monitor"),
                         ("monitor.py", "Ray: autoscaler monitor"),
                         ("multiprocessing", "multiprocessing workers (data loaders)"),
                         ("rayconv.run", "rayconv commands"),
                         ("rayconv.", "other rayconv modules run as commands"), ("execnet", "test processes"),
                         ("sys.stdin.readline", "test processes"), ("pytest", "test processes")):
        if needle in text:
            return name
    return "other: " + (titles[0].split()[0] if titles and titles[0] else "?")


def _carries(pid: str, token: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return token in f.read()
    except OSError:
        return False


def sample(stop: threading.Event, every_s: float, boot_ticks_min: int, token: bytes, seen: dict) -> None:
    """Until ``stop``: each process started after ``boot_ticks_min`` whose environment carries ``token``,
    its titles and its CPU seconds."""
    others: set = set()
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                start, cpu, cmd = _read(pid)
            except (OSError, IndexError, ValueError):
                continue
            if start < boot_ticks_min or (pid, start) in others:
                continue
            if (pid, start) not in seen and not _carries(pid, token):
                others.add((pid, start))
                continue
            rec = seen.setdefault((pid, start), {"titles": [], "cpu": 0.0})
            rec["cpu"] = cpu
            if cmd and cmd not in rec["titles"] and len(rec["titles"]) < 8:
                rec["titles"].append(cmd)
        stop.wait(every_s)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every-s", type=float, default=0.25, help="seconds between two reads of /proc")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the command after --, e.g. -- python -m pytest -q tests")
    me = _read(str(os.getpid()))[0]
    value = f"{os.getpid()}-{time.time_ns()}"
    seen: dict = {}
    stop = threading.Event()
    t = threading.Thread(target=sample, args=(stop, a.every_s, me, f"{TOKEN}={value}".encode(), seen),
                         daemon=True)
    t0 = time.monotonic()
    t.start()
    rc = subprocess.call(command, env={**os.environ, TOKEN: value})
    wall = time.monotonic() - t0
    stop.set()
    t.join()
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for rec in seen.values():
        k = kind(rec["titles"])
        by_kind[k][0] += 1
        by_kind[k][1] += rec["cpu"]
    total = sum(v[1] for v in by_kind.values())
    print(f"{'kind of process':44s} {'count':>6s} {'CPU s':>8s} {'each':>6s} {'share':>6s}")
    for k, (n, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"{k[:44]:44s} {n:6d} {cpu:8.1f} {cpu / n:6.2f} {100 * cpu / max(total, 1e-9):5.0f}%")
    cores = len(os.sched_getaffinity(0))
    print(
        f"CPU {total:.0f} s in {wall:.0f} s of wall time on {cores} cores:"
        f" {100 * total / (wall * cores):.0f}% busy"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

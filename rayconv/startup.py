"""A run's start-up clock: seconds from the command (or the ``rayconv.fit`` call) to each start-up phase.

The driver marks each phase as it ends (``mark``); the actors' setup splits (model built, data on the
device) and their CUDA-graph capture are placed on the driver's clock from what they report
(``mark_actors``). ``summary.json``'s ``startup`` is ``record()``; at the first step the run prints
``line()``: when the step ended and which phase took longest.

    origin      "process start" (the command: /proc/self/stat's start time, so the interpreter's own
                start and every import count; "rayconv import" where the process ran a shell's other
                commands before, ``command_origin``) or "fit call" (``rayconv.fit``, or the command where
                /proc is absent: the monotonic stamp taken when ``rayconv.run`` was imported)
    phases      name -> seconds since the origin at which the phase ended, in the order they ended:
                ray (connected or started; ``ray`` says which), imports (the driver's modules: after ray
                where the actors start first, ``driver.early``; else before it), data
                (the driver's checks: the data's metadata, the model, the plan; before ray where the
                actors cannot start during them, ``driver.early``; ``model_checked`` before it where an actor
                checked the model: the driver's wait for that actor's imports and check), actors_alive (their
                processes started and imported), actors_warmed_up (the slowest actor's wait for its warm-up:
                torch._dynamo where the part is compiled and torchvision imported, the CUDA context made),
                model_built, optimizer_built, data_on_device (the slowest actor's, inside its setup),
                actors_set_up, first_step, graphs_captured (CUDA)
    slowest     {"phase", "s"}: the longest stretch between two consecutive marks up to the first step
    actor_setup_s   the slowest actor's setup splits, seconds from its ``build`` call (``warmed_up``: the
                wait for its warm-up, ``Actor.__init__``)
    ended       (in summary.json) seconds from the origin to the summary: the whole run as its user waited
    model_check "driver"; for a torchvision model and a driver that has not imported torchvision, "actor"
                (rank 0 of the actors the run started early checked it) or "kept actor" (of actors kept
                by a previous run) (``resolve.WarmCheck``)
    actor_process   that actor's process on this clock (from its node's wall clock): process_started,
                init (``__init__`` entered), imported (its training code), alive, warmed_up, build, built;
                ``renewed`` instead of the first four for actors kept from an earlier run

Phases run in parallel where they can (every actor's setup at once), so a stretch is the time the run
waited for that phase after the one before it ended. This module imports nothing heavy: the command
imports it before torch and Ray.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

# name -> what the console line calls it
PHASES = {
    "imports": "driver imports",
    "data": "data, model and plan checks",
    "model_checked": "the model's check by an actor, after its imports",
    "ray": "Ray",
    "actors_alive": "actors starting",
    "actors_warmed_up": "actors importing torch._dynamo and torchvision, making the CUDA context",
    "model_built": "actors building the model",
    "optimizer_built": "actors building the optimizer",
    "data_on_device": "actors putting the data on the device",
    "actors_set_up": "actors setting up",
    "first_step": "first step",
    "graphs_captured": "CUDA graph capture",
}
RAY_HOW = {"started": "Ray starting", "connected": "Ray connecting", "reused": "Ray (connected before)"}


def process_start() -> Optional[float]:
    """The ``time.monotonic()`` value at which this process started: its start time in /proc/self/stat
    (clock ticks after boot, field 22) against CLOCK_BOOTTIME. None where either is missing."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (the command name may hold spaces)
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.monotonic() - max(0.0, age)


class StartupClock:
    """The phases of one run's start-up, as seconds since ``origin`` (a ``time.monotonic()`` value)."""

    def __init__(self, origin: float, since: str):
        self.origin, self.since = origin, since
        self.phases: dict[str, float] = {}
        self.ray: Optional[str] = None        # "started", "connected" or "reused"
        self.actors: dict[str, float] = {}    # the slowest actor's seconds per setup split
        self.timeline: dict[str, float] = {}  # the slowest actor's process stamps, seconds since the origin
        self.claimed = False                  # taken by a run (``claim``): a later run begins its own
        self.model_check: Optional[str] = None   # who checked the model: "driver", "actor" or "kept actor"

    def mark(self, name: str, at: Optional[float] = None) -> None:
        """Phase ``name`` ended now (or at the monotonic time ``at``); the first mark of a name stays
        (a recovery's new actors do not move the start-up's)."""
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}: one of {', '.join(PHASES)}")
        if name not in self.phases:
            self.phases[name] = (time.monotonic() if at is None else at) - self.origin

    def mark_actors(self, reports: list[dict[str, Any]]) -> None:
        """Place the actors' setup splits on this clock, after ``actors_set_up`` was marked: each report's
        ``startup`` holds its setup's seconds (``setup``) and the seconds from its start to
        ``model_built``, ``optimizer_built`` and ``data_on_device``. The slowest actor's setup is the
        one the run waited for: its splits are placed back from ``actors_set_up`` (the return's transit
        is not counted)."""
        timed = [r for r in reports if (r.get("startup") or {}).get("setup") is not None]
        if not timed or "actors_set_up" not in self.phases:
            return
        slowest = max(timed, key=lambda r: r["startup"]["setup"])
        slow = slowest["startup"]
        ended = self.origin + self.phases["actors_set_up"]
        for name, split in (("actors_warmed_up", "warmed_up"), ("model_built", "model_built"),
                            ("optimizer_built", "optimizer_built"), ("data_on_device", "data_on_device")):
            if slow.get(split) is not None:
                self.actors[split] = slow[split]
                self.mark(name, ended - (slow["setup"] - slow[split]))
        self.actors["setup"] = slow["setup"]
        # its process's stamps (wall clock) on this clock: where the seconds before its setup went
        wall_origin = time.time() - (time.monotonic() - self.origin)
        self.timeline = {k: v - wall_origin for k, v in (slowest.get("stamps") or {}).items()
                         if v is not None}

    def mark_capture(self, seconds: list[float]) -> None:
        """The actors' CUDA-graph capture (``seconds``: each capturing actor's) ended now."""
        if seconds and "graphs_captured" not in self.phases:
            self.actors["graph_capture"] = max(seconds)
            self.mark("graphs_captured")

    def ordered(self) -> list[tuple[str, float]]:
        """(name, seconds since the origin) in the order the phases ended."""
        return sorted(self.phases.items(), key=lambda kv: kv[1])

    def stretches(self, until: str = "first_step") -> list[tuple[str, float]]:
        """(name, seconds from the mark before it to its own) for each phase up to ``until``."""
        out, last = [], 0.0
        for name, at in self.ordered():
            out.append((name, at - last))
            last = at
            if name == until:
                break
        return out

    def slowest(self) -> Optional[tuple[str, float]]:
        """The phase with the longest stretch up to the first step (None before any mark)."""
        st = self.stretches()
        return max(st, key=lambda kv: kv[1]) if st else None

    def label(self, name: str) -> str:
        return RAY_HOW.get(self.ray or "", "Ray") if name == "ray" else PHASES[name]

    def line(self, step: int = 0) -> str:
        """The console line at the first step (``step``: its number): when it ended, since what, and the
        slowest phase."""
        done = self.phases.get("first_step")
        name, s = self.slowest() or ("first_step", 0.0)
        when = f"{done:.1f} s {after(self.since)}" if done is not None else "(not reached)"
        return f"rayconv: step {step} done {when}; slowest: {self.label(name)} ({s:.1f} s)"

    def elapsed(self) -> float:
        """Seconds from the origin to now."""
        return time.monotonic() - self.origin

    def record(self) -> dict[str, Any]:
        """summary.json's ``startup`` (see the module docstring)."""
        slow = self.slowest()
        return {"origin": self.since, "ray": self.ray, "model_check": self.model_check,
                "phases": {k: round(v, 4) for k, v in self.ordered()},
                "slowest": {"phase": slow[0], "s": round(slow[1], 4)} if slow else None,
                "actor_setup_s": {k: round(v, 4) for k, v in self.actors.items()},
                "actor_process": {k: round(v, 4)
                                  for k, v in sorted(self.timeline.items(), key=lambda kv: kv[1])}}


def after(origin: str) -> str:
    """Words for seconds counted from ``origin`` (a clock's ``since``): "after the command", ..."""
    return {"fit call": "after rayconv.fit was called", "main call": "after rayconv.run.main was called",
            "rayconv import": "after rayconv was imported"}.get(origin, "after the command")


# The clock of the run in progress in this process (None outside one): the driver's modules mark it
# without passing it through every call.
_current: Optional[StartupClock] = None


def begin(origin: Optional[float], since: str) -> StartupClock:
    """Start the clock of a new run (``origin`` None: now)."""
    global _current
    _current = StartupClock(time.monotonic() if origin is None else origin, since)
    return _current


def begin_command(imported: float) -> StartupClock:
    """The clock of ``rayconv.run.main``: from the process's start (``command_origin``) when it runs as a
    command: ``python -m rayconv.run``, the ``rayconv`` console command or a script such as
    ``examples/*.py`` (a main call within ``EXEC_GAP_S`` of ``imported``, the monotonic stamp taken when
    ``rayconv.run`` is imported); else, when Python calls it well after that import (an interactive
    interpreter, a test), from the call ("main call")."""
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if (spec is not None and spec.name == "rayconv.run") or time.monotonic() - imported <= EXEC_GAP_S:
        import rayconv

        return begin(*command_origin(process_start(), rayconv.IMPORTED, imported))
    return begin(None, "main call")


EXEC_GAP_S = 2.0  # more between the process's start and rayconv's import: the process ran other commands


def command_origin(started: Optional[float], package: float, imported: float) -> tuple[float, str]:
    """(origin, its name) of the command's clock from the monotonic stamps of the process's start
    (None where /proc is absent), the rayconv package's import and ``rayconv.run``'s: the process's
    start, unless rayconv was imported more than ``EXEC_GAP_S`` after it (the process first ran a
    shell's other commands, e.g. ``bash -c 'pip install ... && python -m rayconv.run'``, whose last
    command the shell runs in its own process): then the package's import."""
    if started is None:
        return imported, "rayconv.run import"
    if package - started > EXEC_GAP_S:
        return package, "rayconv import"
    return started, "process start"


def current() -> Optional[StartupClock]:
    return _current


def claim() -> StartupClock:
    """The clock begun for the run about to start (by the command or ``rayconv.fit``), or one begun
    now where none waits (a caller of ``driver.job.fit`` itself)."""
    if _current is None or _current.claimed:
        begin(None, "fit call")
    _current.claimed = True
    return _current


def mark(name: str, at: Optional[float] = None) -> None:
    """``StartupClock.mark`` on the run in progress (nothing outside one)."""
    if _current is not None:
        _current.mark(name, at)

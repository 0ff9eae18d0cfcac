"""--elastic MIN: a run that loses actors or nodes continues on the devices left, and grows back.

The rule (``policies.ElasticScaling``, ``policies.plan_mesh``): the global batch stays, and so do pp,
fs, the per-layer plan, the schedule, the micro-batches and the pipeline cut; dp becomes the largest
that is at most the starting dp, fits the free devices (``dp * pp * fs``), splits the global batch
and passes --max-memory-gib when given. Every layout computes the same SGD step from (seed, step), so
the run ends with the weights of a run that never changed.

Events (the controller, ``driver.job``, carries out the policies' decisions), each one console line
(step, old layout -> new, why, seconds lost until the next step is done, or the final export after a
loss past the last step) and one row of ``layout_changes`` in summary.json (``LayoutChanges``):

- an actor or node lost (``ClusterError``, recoverable; counted against --max-failures, no limit unless
  given: ``Config.failure_budget``): the driver waits up to --elastic-wait seconds for the layout's
  devices, then re-plans on what is free and continues from the last checkpoint
  (``checkpoint.rank_file_for`` cuts it for the new layout);
- a preemption with notice (an actor's SIGTERM, marked in its next step's metrics; a node draining,
  looked for every ``DRAIN_POLL_S`` by ``DrainWatch``): the driver writes a checkpoint at the step
  boundary, so no finished step is lost, stops the actors and re-plans (not counted as a failure);
- devices back: at each checkpoint of a shrunk run, when the cluster's free devices plus the run's
  own hold the starting layout, the actors stop after the checkpoint and the starting layout
  continues from it.

Below MIN the driver waits within --max-wait for devices (``continue_mesh``), then raises
``TooFewDevices`` (exit status 2, the last checkpoint kept, the resume command in its one line).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rayconv.cluster.nodes import draining_nodes, free_slots
from rayconv.config import Config
from rayconv.errors import ConfigError, TooFewDevices
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import latest_checkpoint
from rayconv.planner.search import memory_check
from rayconv.driver.policies import ScalingPolicy
from rayconv.settings import ClusterSettings

DRAIN_POLL_S = 5.0   # seconds between two looks at the cluster's draining nodes
POLL_S = 0.1         # seconds between two looks at the free devices while waiting


def cluster_free(cfg: ClusterSettings) -> int:
    """The connected cluster's free actor slots for ``cfg``'s device, draining nodes left out."""
    return free_slots(cfg.device, cfg.num_cpus_per_actor)


def memory_fits(cfg: Config) -> Callable[[Mesh], bool]:
    """Whether a mesh passes --max-memory-gib for ``cfg`` (always, without it)."""
    def fits(mesh: Mesh) -> bool:
        try:
            memory_check(dataclasses.replace(cfg, dp=mesh.dp))
        except ConfigError:
            return False
        return True
    return fits


class DrainWatch:
    """Every ``DRAIN_POLL_S`` seconds, the nodes of the running actors that are being drained."""

    def __init__(self, nodes: set[str]):
        self.nodes, self.next_poll = nodes, 0.0

    def draining(self) -> Optional[str]:
        """"node <id> is draining" for one such node when a look is due and finds it, else None."""
        now = time.monotonic()
        if now < self.next_poll:
            return None
        self.next_poll = now + DRAIN_POLL_S
        drained = self.nodes & draining_nodes()
        return f"node {sorted(drained)[0][:12]} is draining" if drained else None


def wait_for_devices(free: Callable[[], int], devices: int, seconds: float) -> None:
    """Up to ``seconds`` for ``devices`` free slots (a stopped or lost actor's resources coming back)."""
    deadline = time.monotonic() + seconds
    while free() < devices and time.monotonic() < deadline:
        time.sleep(POLL_S)


def continue_mesh(policy: ScalingPolicy, max_wait: float, out: Path, log=print,
                  free: Callable[[], int] = lambda: 0) -> Mesh:
    """The mesh to continue on: ``policy.choose`` over the ``free()`` devices, looked at every ``POLL_S``
    while it says wait (one line the first time), within ``max_wait`` seconds. Raises TooFewDevices
    (``below_minimum``'s line) when it says stop."""
    deadline = time.monotonic() + max_wait
    said = False
    while True:
        devices = free()
        decision = policy.choose(devices, waited_out=time.monotonic() >= deadline)
        if decision.action == "resize":
            assert decision.mesh is not None
            return decision.mesh
        if decision.action == "stop":
            raise TooFewDevices(below_minimum(devices, policy.minimum, max_wait, out))
        if not said:
            log(f"rayconv: {decision.why}: waiting up to {max_wait:.0f} s (--max-wait)")
            said = True
        time.sleep(POLL_S)


def below_minimum(devices: int, minimum: int, waited_s: float, out: Path) -> str:
    """TooFewDevices' one line: what is free, what --elastic needs, the checkpoint kept, how to resume."""
    ckpt = latest_checkpoint(out)
    kept = f"last checkpoint {ckpt} kept" if ckpt is not None else "no checkpoint written yet"
    return (f"{devices} devices free after waiting {waited_s:.0f} s (--max-wait), --elastic needs {minimum}: "
            f"stopped, {kept}: add devices, then continue with `python -m rayconv.run --resume {out}`")


class LayoutChanges:
    """summary.json's ``layout_changes`` rows, and the change whose first step is not done yet: its
    seconds lost are counted from its detection (``begin``) through each phase (``mark``) to its
    first step (``settle``)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.pending: Optional[dict[str, Any]] = None

    def begin(self, step: int, old: str, new: str, why: str, steps_redone: int, t_detect: float,
              devices_free: float) -> None:
        self.pending = {"step": step, "from": old, "to": new, "why": why, "steps_redone": steps_redone,
                        "t_detect": t_detect, "phases": {"devices_free": devices_free}}

    def mark(self, phase: str) -> None:
        """Seconds from the pending change's detection to ``phase`` done (its row's ``phases``)."""
        if self.pending is not None:
            self.pending["phases"][phase] = round(time.monotonic() - self.pending["t_detect"], 3)

    def settle(self, log=print) -> None:
        """The pending change's console line and row, its seconds lost counted to now: its first step
        done, or (a loss after the last step) the final export done."""
        if self.pending is None:
            return
        change, self.pending = self.pending, None
        change["seconds_lost"] = round(time.monotonic() - change.pop("t_detect"), 3)
        change["phases"]["first_step"] = change["seconds_lost"]
        self.rows.append(change)
        log(f"rayconv: step {change['step']}: layout {change['from']} -> {change['to']} ({change['why']}); "
            f"{change['seconds_lost']:.1f} s lost ({phase_words(change['phases'])}), "
            f"steps redone: {change['steps_redone']}")


PHASE_WORDS = {"devices_free": "stopped, devices free", "actors_alive": "actors started",
               "actors_set_up": "set up", "checkpoint_loaded": "checkpoint loaded",
               "first_step": "first step"}


def phase_words(phases: dict[str, float]) -> str:
    """A change's ``phases`` (seconds from its detection to each phase done, in order) as the seconds
    each phase took: "stopped, devices free 1.2 s, actors started 4.0 s, ..."."""
    out, last = [], 0.0
    for name, t in phases.items():
        out.append(f"{PHASE_WORDS.get(name, name)} {t - last:.1f} s")
        last = t
    return ", ".join(out)


def first_words(text: str) -> str:
    """A ClusterError's cause, short: its text up to the first ``": "`` (who was lost, in which call)."""
    return text.splitlines()[0].split(": ")[0] if text else "an actor was lost"

"""--elastic MIN: a run that loses actors or nodes continues on the devices left, and grows back.

The rule (``plan_mesh``): the global batch stays, and so do pp, fs, the per-layer plan, the schedule,
the micro-batches and the pipeline cut; dp becomes the largest that is at most the starting dp, fits
the free devices (``dp * pp * fs``) and splits the global batch (``batch_split_problem``), and passes
--max-memory-gib when given. Every layout computes the same SGD step from (seed, step), so the run
ends with the weights of a run that never changed.

Events, each one console line (step, old layout -> new, why, seconds lost until the next step is done,
or the final export after a loss past the last step) and one row of ``layout_changes`` in summary.json:

- an actor or node lost (``ClusterError``, recoverable; counted against --max-failures, no limit unless
  given: ``Config.failure_budget``): the
  driver waits up to --elastic-wait seconds for the layout's devices, then re-plans on what is free and
  continues from the last checkpoint (``checkpoint.rank_file_for`` cuts it for the new layout);
- a preemption with notice (an actor's SIGTERM, marked in its next step's metrics; a node draining,
  polled every ``DRAIN_POLL_S``): the driver writes a checkpoint at the step boundary, so no finished
  step is lost, stops the actors and re-plans (not counted as a failure);
- devices back: at each checkpoint of a shrunk run, when the cluster's free devices plus the run's
  own hold the starting layout, the actors stop after the checkpoint and the starting layout
  continues from it.

Below MIN the driver waits within --max-wait for devices, then raises ``TooFewDevices`` (exit status 2,
the last checkpoint kept, the resume command in its one line).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import ray

from rayconv.config import batch_split_problem
from rayconv.driver.loop import Run, checkpoint
from rayconv.driver.saving import settle
from rayconv.driver.resolve import ResolvedRun
from rayconv.errors import ClusterError, ConfigError, TooFewDevices
from rayconv.layout import Layout
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import Checkpoint, check_resumable, latest_checkpoint, load_checkpoint
from rayconv.planner.search import memory_check

DRAIN_POLL_S = 5.0   # seconds between two looks at the cluster's draining nodes
POLL_S = 0.1         # seconds between two looks at the free devices while waiting (a stopped run's are free a moment after)
GROW = "devices came back"


class LayoutChange(ClusterError):
    """Raised at a step boundary once a checkpoint of it is written: stop the actors and continue on
    the layout ``Elastic.recover`` picks (a preemption: ``why`` says whose; a grow back)."""

    def __init__(self, msg: str, why: str):
        super().__init__(msg, recoverable=True)
        self.why = why


def plan_mesh(start: Mesh, devices: int, global_batch_size: int, num_microbatches: int,
              fits: Callable[[Mesh], bool] = lambda mesh: True) -> Optional[Mesh]:
    """The module's rule: ``start`` with the largest dp <= ``start.dp`` whose ``dp * pp * fs`` actors
    fit ``devices``, whose replicas split ``global_batch_size`` into ``num_microbatches`` each, and
    that ``fits`` (memory); None when no dp does."""
    for dp in range(min(start.dp, devices // (start.pp * start.fs)), 0, -1):
        mesh = Mesh(dp, start.pp, start.fs)
        if batch_split_problem(global_batch_size, dp, num_microbatches) is None and fits(mesh):
            return mesh
    return None


def free_devices(per_node: dict[str, dict[str, float]], draining: set[str], device: str, per_actor: int) -> int:
    """Actor slots free on the nodes ``per_node`` (node id -> available resources, as Ray's
    ``available_resources_per_node``) that are not ``draining``: GPUs (with a CPU each) for cuda,
    ``per_actor`` CPUs each for cpu."""
    slots = 0
    for node, res in per_node.items():
        if node in draining:
            continue
        cpus = int(res.get("CPU", 0) + 1e-9)
        slots += min(int(res.get("GPU", 0) + 1e-9), cpus) if device == "cuda" else cpus // max(1, per_actor)
    return slots


def draining_nodes() -> set[str]:
    """Hex ids of the nodes being drained (``ray drain-node``, the autoscaler's preemption notice)."""
    return set(ray._private.state.state.get_draining_nodes())


def cluster_free(cfg: Any) -> int:
    """The connected cluster's free actor slots for ``cfg``'s device, draining nodes left out."""
    return free_devices(ray._private.state.available_resources_per_node(), draining_nodes(), cfg.device,
                        cfg.num_cpus_per_actor)


class Elastic:
    """The elastic part of one run (``attach``): the layout it started with, and the change in progress."""

    def __init__(self, run: Run):
        self.start: ResolvedRun = run.resolved
        self.minimum: int = run.cfg.elastic
        self.nodes: set[str] = set()      # the nodes of the actors running now
        self.next_poll = 0.0
        self.pending: Optional[dict[str, Any]] = None   # the change whose first step is not done yet

    # ------------------------------------------------------------------ hooks of the step loop
    def started(self, actor_group: Any) -> None:
        self.nodes = {i["node_id"] for i in actor_group.info}

    def step_done(self, run: Run, step: int) -> None:
        """After ``step``'s metrics: the pending change's line and row (``settle``); every
        ``DRAIN_POLL_S`` a look for a draining node under the actors (a preemption notice)."""
        self.settle(run)
        now = time.monotonic()
        if now >= self.next_poll and run.preempted is None:
            self.next_poll = now + DRAIN_POLL_S
            drained = self.nodes & draining_nodes()
            if drained:
                run.preempted = f"node {sorted(drained)[0][:12]} is draining"

    def settle(self, run: Run) -> None:
        """The pending change's console line and ``layout_changes`` row, its seconds lost counted to
        now: its first step done, or (a loss after the last step) the final export done."""
        if self.pending is None:
            return
        change, self.pending = self.pending, None
        change["seconds_lost"] = round(time.monotonic() - change.pop("t_detect"), 3)
        change["phases"]["first_step"] = change["seconds_lost"]
        run.layout_changes.append(change)
        run.log(f"rayconv: step {change['step']}: layout {change['from']} -> {change['to']} ({change['why']}); "
                f"{change['seconds_lost']:.1f} s lost ({phase_words(change['phases'])}), "
                f"steps redone: {change['steps_redone']}")

    def mark(self, phase: str) -> None:
        """Seconds from the pending change's detection to ``phase`` done (its row's ``phases``)."""
        if self.pending is not None:
            self.pending["phases"][phase] = round(time.monotonic() - self.pending["t_detect"], 3)

    def at_boundary(self, run: Run, actor_group: Any, done: int) -> None:
        """After a step boundary's work: on a preemption, the checkpoint of ``done`` steps (if not just
        written), then LayoutChange; at a checkpoint of a shrunk run whose starting layout fits again,
        LayoutChange. Nothing at the run's last step."""
        if done >= run.resolved.total_steps:
            return
        if run.preempted is not None:
            if not run.checkpoint_due(done):
                checkpoint(run, actor_group, done)
                run.metrics.write(run.resolved.out / "metrics.parquet")
            settle(run, actor_group)   # (the checkpoint complete before these actors stop)
            raise LayoutChange(f"{run.preempted}: checkpoint of step {done} written", why=run.preempted)
        want, have = self.start.mesh.world_size, run.resolved.mesh.world_size
        if run.checkpoint_due(done) and have < want and cluster_free(run.cfg) + have >= want:
            settle(run, actor_group)
            raise LayoutChange("the starting layout fits again", why=GROW)

    # ------------------------------------------------------------------ after the actors stopped
    def recover(self, e: ClusterError, run: Run, recover_or_raise: Callable[[ClusterError, Run], Optional[Checkpoint]]
                ) -> Optional[Checkpoint]:
        """The checkpoint to continue from, with ``run`` moved onto the layout to continue on. A loss
        goes through ``recover_or_raise`` (counted against --max-failures; raises what it raises); a
        LayoutChange continues from the checkpoint it wrote. Raises TooFewDevices below --elastic."""
        t_detect = time.monotonic()
        done = next((r["step"] + 1 for r in reversed(run.metrics.rows) if r["kind"] == "train"), 0)
        run.preempted = None
        old = run.resolved
        if isinstance(e, LayoutChange):
            why = e.why
            ckpt = load_checkpoint(latest_checkpoint(old.out))
        else:
            ckpt = recover_or_raise(e, run)
            why = _first_words(str(e))
        # (the stopped actors' resources are released a moment after they stop; a lost node's are not)
        grow = isinstance(e, LayoutChange) and e.why == GROW
        self.wait(run, (self.start if grow else old).mesh.world_size, run.cfg.elastic_wait)
        devices_free = round(time.monotonic() - t_detect, 3)
        mesh = self.choose(run)
        new = self.resolved_for(mesh)
        if ckpt is not None:
            check_resumable(ckpt, new.cfg, new.mesh, new.routing.stages, new.source.num_classes,
                            tuple(new.source.sample_shape))
        run.use(new)
        start = ckpt.step if ckpt is not None else 0
        self.pending = {"step": start, "from": Layout.from_config(old.cfg).name, "to": run.layout_name, "why": why,
                        "steps_redone": max(0, done - start), "t_detect": t_detect,
                        "phases": {"devices_free": devices_free}}
        return ckpt

    def choose(self, run: Run) -> Mesh:
        """The mesh to continue on (``continue_mesh`` from the starting layout). Raises TooFewDevices."""
        return continue_mesh(self.start.cfg, self.start.mesh, self.minimum, run.resolved.out, run.log, fits=self.fits)

    def wait(self, run: Run, devices: int, seconds: float) -> None:
        """Up to ``seconds`` for ``devices`` free slots (a lost actor's resources coming back)."""
        deadline = time.monotonic() + seconds
        while cluster_free(run.cfg) < devices and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def fits(self, mesh: Mesh) -> bool:
        """Whether ``mesh`` passes --max-memory-gib (always, without it)."""
        try:
            memory_check(dataclasses.replace(self.start.cfg, dp=mesh.dp))
        except ConfigError:
            return False
        return True

    def resolved_for(self, mesh: Mesh) -> ResolvedRun:
        """The starting run on ``mesh``: dp changed in the settings, the routing and the sharding; the
        pipeline cut, the schedule and the rest stay (the routing's stages do not depend on dp)."""
        s = self.start
        if mesh == s.mesh:
            return s
        cfg = dataclasses.replace(s.cfg, dp=mesh.dp).validate()
        return dataclasses.replace(s, cfg=cfg, mesh=mesh, routing=dataclasses.replace(s.routing, mesh=mesh),
                                   sharding=dataclasses.replace(s.sharding, dp=mesh.dp))


def continue_mesh(cfg: Any, start: Mesh, minimum: int, out: Any, log=print,
                  free: Callable[[Any], int] = cluster_free, fits: Callable[[Mesh], bool] = lambda mesh: True) -> Mesh:
    """The mesh to continue on: ``plan_mesh`` of ``start`` over the ``free(cfg)`` devices; while it would
    have fewer than ``minimum`` actors, one line and a wait within ``cfg.max_wait`` seconds (the free
    devices looked at every ``POLL_S``). Raises TooFewDevices (``below_minimum``'s line) when the wait
    ends below ``minimum``."""
    deadline = time.monotonic() + cfg.max_wait
    said = False
    while True:
        devices = free(cfg)
        mesh = plan_mesh(start, devices, cfg.global_batch_size, cfg.num_microbatches, fits)
        if mesh is not None and mesh.world_size >= minimum:
            return mesh
        if time.monotonic() >= deadline:
            raise TooFewDevices(below_minimum(devices, minimum, cfg.max_wait, out))
        if not said:
            log(f"rayconv: {devices} devices free, --elastic needs {minimum}: waiting up to "
                f"{cfg.max_wait:.0f} s (--max-wait)")
            said = True
        time.sleep(POLL_S)


def below_minimum(devices: int, minimum: int, waited_s: float, out: Any) -> str:
    """TooFewDevices' one line: what is free, what --elastic needs, the checkpoint kept, how to resume."""
    ckpt = latest_checkpoint(out)
    kept = f"last checkpoint {ckpt} kept" if ckpt is not None else "no checkpoint written yet"
    return (f"{devices} devices free after waiting {waited_s:.0f} s (--max-wait), --elastic needs {minimum}: "
            f"stopped, {kept}: add devices, then continue with `python -m rayconv.run --resume {out}`")


PHASE_WORDS = {"devices_free": "stopped, devices free", "actors_alive": "actors started",
               "actors_set_up": "set up", "checkpoint_loaded": "checkpoint loaded", "first_step": "first step"}


def phase_words(phases: dict[str, float]) -> str:
    """A change's ``phases`` (seconds from its detection to each phase done, in order) as the seconds
    each phase took: "stopped, devices free 1.2 s, actors started 4.0 s, ..."."""
    out, last = [], 0.0
    for name, t in phases.items():
        out.append(f"{PHASE_WORDS.get(name, name)} {t - last:.1f} s")
        last = t
    return ", ".join(out)


def _first_words(text: str) -> str:
    """A ClusterError's cause, short: its text up to the first ``": "`` (who was lost, in which call)."""
    return text.splitlines()[0].split(": ")[0] if text else "an actor was lost"


def attach(run: Run) -> None:
    """Make ``run`` elastic when its settings ask (--elastic)."""
    run.elastic = Elastic(run) if run.cfg.elastic is not None else None

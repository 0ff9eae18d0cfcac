"""The driver's two policies: plain inputs in (free devices, the layout now, the step, a loss, the
failures so far), a ``Decision`` out. No Ray, no files, no clock: the controller (``driver.job``)
gathers the inputs and carries the decision out; tests/unit/test_policies.py checks the rules alone.

- The scaling policy: ``FixedScaling`` (the layout as resolved, all run long) or ``ElasticScaling``
  (--elastic MIN). At a step boundary it says continue, or resize (an actor's SIGTERM or a draining
  node: onto the devices left; a shrunk run whose starting layout fits again: back onto it). Once the
  actors stopped it picks the layout to continue on from the free devices (``plan_mesh``), says wait
  while that is below MIN, and stop once the wait is over.
- The failure policy: after actors were lost, restart (the same layout), resize (--elastic: the
  scaling policy picks the layout) or stop (not recoverable, or no failure left of --max-failures).

Ray Train's controller (``ray.train.v2``: ScalingPolicy, FailurePolicy) splits its decisions alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from rayconv.config import batch_split_problem
from rayconv.mesh import Mesh

GROW = "devices came back"


@dataclass(frozen=True)
class Decision:
    """What the driver does next: ``action`` one of ``ACTIONS``; ``mesh`` the layout to go on with (a
    resize once chosen: None while the actors still run and the free devices are not known yet);
    ``why`` the cause in a few words (the console line and summary.json's ``layout_changes`` row)."""

    action: str
    mesh: Optional[Mesh] = None
    why: str = ""

    ACTIONS = ("continue", "resize", "restart", "wait", "stop")

    def __post_init__(self) -> None:
        if self.action not in self.ACTIONS:
            raise ValueError(f"decision {self.action!r} is not one of {self.ACTIONS}")


CONTINUE = Decision("continue")


def plan_mesh(start: Mesh, devices: int, global_batch_size: int, num_microbatches: int,
              fits: Callable[[Mesh], bool] = lambda mesh: True) -> Optional[Mesh]:
    """``start`` with the largest dp <= ``start.dp`` whose ``dp * pp * fs`` actors fit ``devices``,
    whose replicas split ``global_batch_size`` into ``num_microbatches`` each, and that ``fits``
    (--max-memory-gib); None when no dp does. pp, fs, the pipeline cut and the schedule stay."""
    for dp in range(min(start.dp, devices // (start.pp * start.fs)), 0, -1):
        mesh = Mesh(dp, start.pp, start.fs)
        if batch_split_problem(global_batch_size, dp, num_microbatches) is None and fits(mesh):
            return mesh
    return None


@dataclass(frozen=True)
class FixedScaling:
    """The layout as resolved for the whole run: never a resize; after a loss, the same layout."""

    start: Mesh
    watches_cluster = False   # (no look at the cluster's free devices or draining nodes)

    def at_boundary(self, done: int, total: int, checkpoint_due: bool, current: Mesh, free: int,
                    preempted: Optional[str] = None) -> Decision:
        return CONTINUE

    def devices_to_wait_for(self, current: Mesh, why: str) -> int:
        return current.world_size

    def choose(self, free: int, waited_out: bool) -> Decision:
        return Decision("resize", self.start)


@dataclass(frozen=True)
class ElasticScaling:
    """--elastic MIN over the starting layout ``start``: ``minimum`` actors at least, the global batch
    split into ``num_microbatches`` per replica, ``fits`` the memory check of a layout."""

    start: Mesh
    minimum: int
    global_batch_size: int
    num_microbatches: int
    fits: Callable[[Mesh], bool] = lambda mesh: True
    watches_cluster = True

    def at_boundary(self, done: int, total: int, checkpoint_due: bool, current: Mesh, free: int,
                    preempted: Optional[str] = None) -> Decision:
        """After ``done`` of ``total`` steps, on ``current``, with ``free`` devices free besides the
        run's own: resize on a preemption notice (``preempted``: whose) and, at a checkpoint of a
        shrunk run, when the starting layout fits again; else continue (always at the last step)."""
        if done >= total:
            return CONTINUE
        if preempted is not None:
            return Decision("resize", why=preempted)
        want, have = self.start.world_size, current.world_size
        if checkpoint_due and have < want and free + have >= want:
            return Decision("resize", self.start, GROW)
        return CONTINUE

    def devices_to_wait_for(self, current: Mesh, why: str) -> int:
        """The free devices worth a wait of --elastic-wait once the actors stopped: the starting
        layout's for a grow back, else the layout's that ran (a lost actor's resources coming back)."""
        return (self.start if why == GROW else current).world_size

    def choose(self, free: int, waited_out: bool) -> Decision:
        """Once the actors stopped, with ``free`` devices: resize to ``plan_mesh``'s layout when it has
        ``minimum`` actors; else wait, or stop when the wait (--max-wait) is ``waited_out``."""
        mesh = plan_mesh(self.start, free, self.global_batch_size, self.num_microbatches, self.fits)
        if mesh is not None and mesh.world_size >= self.minimum:
            return Decision("resize", mesh)
        if not waited_out:
            return Decision("wait", why=f"{free} devices free, --elastic needs {self.minimum}")
        return Decision("stop", why=f"{free} devices free after waiting, --elastic needs {self.minimum}")


ScalingPolicy = Union[FixedScaling, ElasticScaling]


@dataclass(frozen=True)
class FailurePolicy:
    """Actors lost: ``max_failures`` recoveries in all (``Config.failure_budget``: --max-failures, -1 for
    no limit, --elastic's default); ``elastic``: recover by a resize (the scaling policy picks the layout
    from what is free) instead of a restart."""

    max_failures: int
    elastic: bool = False

    def decide(self, why: str, recoverable: bool, failures: int) -> Decision:
        """After a loss (``why``: its cause; ``recoverable``: a lost process, node or collective, not a
        refusal) with ``failures`` recovered so far: restart, resize, or stop with the reason."""
        if not recoverable:
            return Decision("stop", why=why)
        if 0 <= self.max_failures <= failures:
            return Decision("stop", why=f"{failures} of --max-failures {self.max_failures} recovered: give "
                            "--max-failures N (-1: no limit) with --checkpoint-every to recover from more")
        return Decision("resize" if self.elastic else "restart", why=why)

"""Checkpoints written by the actors, in the background; the driver writes each one's manifest, last.

What is written when. At the step boundary of a checkpoint of k steps (``start``) the driver calls
``Actor.checkpoint_start`` on every actor: each copies what its rank file holds to host memory (one copy
of each tensor over the data-parallel replicas, ``outputs/rank_files.py``) and returns, and a background
thread of the actor serialises it and writes ``rank-<r>.pt`` into ``<out>/checkpoints/step-<k>/``
(``actor/saver.py``) while training continues. Where nothing else needs the actors quiet at that
boundary (``Run.drains``: no evaluation, test hook or preemption mark, a scaling policy that does not
watch the cluster, not the run's last step) the call is queued right behind step k-1's ``train_step``
and step k's is queued behind it, nothing waited for: Ray runs an actor's calls in the order they were
submitted, so the copy is of the state after k steps; the calls are collected later (``note``: a failure
raised there as any actor call's). At the other boundaries the loop lets the actors go quiet first
(``flush``) and waits for the calls.

The actors report each rank file's name, size and sha256 with a later step's metrics (``note``, the
loop's poll) or when asked (``settle``: before the run's end, a layout change, the test hook, a stop).
Once all have, and the metrics row of step k-1 is in (a step's row comes back with the next step's
call), the driver takes the rows of the steps before k for the checkpoint's ``metrics.parquet`` and, on
a thread of its own (``Checkpoints.completing``: the step loop never waits on a disk or a bucket),
writes it and then ``manifest.json``, which alone makes the checkpoint complete
(``checkpoint.write_manifest``), prunes to --keep-checkpoints, and removes the rank files of older
checkpoints that never completed (``checkpoint.remove_partial``: a failed write, a stopped run's).
Checkpoints complete in the order they began. Each actor's ``checkpoint_start`` waits for its own
previous write and keeps that write's result until handed over, so a checkpoint may begin before the
driver has the results of the one before: two can be open at once (``Checkpoints.open``). No tensor
passes through the driver. A write that failed (after the actors' retries) is one line; the previous
checkpoint stays the newest complete one.

A step folder that was there when the attempt began (``Checkpoints.listed``, one listing: a run resumed
in its own folder or recovered, writing a step again) is emptied on the step loop, its manifest first,
before any actor writes into it, so that no manifest lists a rank file it did not see written; no other
checkpoint costs the step loop a request to the storage.

Where the rank files go (``route``, said once on the console): a bucket, or a local ``--out`` on the
driver's disk, which actors on the driver's node write directly; an actor on another node (which may
not see that disk) streams its rank file through a writer on the driver's node (``cluster/sink.py``).

Before the first step of a run whose actors will write checkpoints into a store (``check_nodes``), one
actor on each node writes and deletes a probe object in the run's folder with its node's credentials
and endpoint: a node that cannot is one line naming it (exit status 2), before anything is written.

``RAYCONV_SYNC_CHECKPOINTS=1`` keeps the synchronous form (each actor's whole state through the driver,
written before training continues, at a boundary where the actors are quiet: format 1), for the
benchmark's comparison (``benchmarks/checkpoint_stall.py``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import ray

from rayconv.actor.actor import Actor
from rayconv.cluster.calls import Pending
from rayconv.cluster.group import ActorGroup
from rayconv.cluster.sink import SinkFolder, needs_sink, start_sink
from rayconv.driver.lr import learning_rate, peak_lr, warmup_steps
from rayconv.outputs.checkpoint import (latest_checkpoint, prune, remove_partial, step_folders,
                                        write_checkpoint, write_manifest)
from rayconv.storage import Location, Place, StorageError, describe, locate, remove

SYNC_ENV = "RAYCONV_SYNC_CHECKPOINTS"


def synchronous() -> bool:
    """Whether checkpoints take the synchronous form (``RAYCONV_SYNC_CHECKPOINTS=1``)."""
    return os.environ.get(SYNC_ENV) == "1"


@dataclass
class Writing:
    """A checkpoint begun and not complete: its step, folder, the manifest as of the step, the actor
    group writing it, its ``checkpoint_start`` calls while not collected, the results in so far (file
    name -> result) and the metrics rows taken for it (``metrics.parquet``'s bytes) once complete."""

    step: int
    folder: Place
    manifest: dict[str, Any]
    group: ActorGroup
    world_size: int
    started: Optional[Pending] = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    metrics: bytes = b""

    @property
    def reported(self) -> bool:
        return len(self.results) + len(self.errors) >= self.world_size


@dataclass
class Route:
    """Where each actor of ``group`` writes: its target folder (per rank) for a checkpoint folder."""

    group: ActorGroup
    through_sink: list[bool]
    sink: Any = None

    def target(self, rank: int, folder: Place) -> Any:
        if self.through_sink[rank]:
            return SinkFolder(self.sink, str(folder))
        return folder if isinstance(folder, Location) else locate(str(folder))


@dataclass
class Checkpoints:
    """The run's checkpoints as the driver keeps them (``Run.checkpoints``), across its attempts."""

    route: Optional[Route] = None   # the current actor group's (``route``)
    open: list[Writing] = field(default_factory=list)   # begun, not complete: oldest first
    completing: Optional[threading.Thread] = None   # the manifest written last, or being written
    newest: Optional[Place] = None   # the last this run completed
    nodes_checked: set[str] = field(default_factory=set)   # node ids (``check_nodes``)
    listed: Optional[set[int]] = None   # step folders there at the attempt's start (None: not known)


def begin_attempt(run: Any, group: ActorGroup) -> None:
    """Before an attempt's first step: the manifests written so far waited for, the checkpoints of
    actors that are gone dropped (their rank files removed after the next manifest), and the step
    folders there now listed (module docstring)."""
    ck: Checkpoints = run.checkpoints
    _drop_others(ck, group)
    if ck.completing is not None:
        ck.completing.join()
    ck.listed = None
    if run.cfg.checkpoint_every or run.cfg.elastic is not None:
        try:
            ck.listed = step_folders(run.resolved.out)
        except OSError:
            pass   # (not known: every step folder emptied before its checkpoint)


def route(run: Any, group: ActorGroup) -> Route:
    """How ``group``'s actors reach the run's checkpoints (module docstring), decided once per group
    and said on the console."""
    ck: Checkpoints = run.checkpoints
    old = ck.route
    if old is not None and old.group is group:
        return old
    if old is not None and old.sink is not None:
        ray.kill(old.sink)
    out = run.resolved.out
    driver = ray.get_runtime_context().get_node_id()
    through = needs_sink(isinstance(out, Path), driver, [i.get("node_id") for i in group.info])
    r = Route(group, through, start_sink(driver) if any(through) else None)
    where = describe(out / "checkpoints")
    n = sum(through)
    run.log(f"rayconv: checkpoints to {where}: each actor writes its own rank file"
            + (f"; {n} actors on other nodes send theirs through a writer on the driver's node (the folder "
               "is this node's disk)" if n else ""))
    ck.route = r
    return r


def check_nodes(run: Any, group: ActorGroup) -> None:
    """Where ``group``'s actors will write checkpoints into a store (the run's folder is a store's
    URI, with --checkpoint-every or --elastic's preemption checkpoints): one actor on each node this run
    has not checked yet writes and deletes a probe object there (``Actor.can_write``), with its node's
    own environment. Raises StorageError, one line naming the node and what to change."""
    out, cfg = run.resolved.out, run.cfg
    if not isinstance(out, Location) or not (cfg.checkpoint_every or cfg.elastic is not None) \
            or synchronous():
        return
    checked = run.checkpoints.nodes_checked
    first: dict[str, int] = {}   # node id -> the first rank on it
    for rank, info in enumerate(group.info):
        if info.get("node_id") not in checked:
            first.setdefault(info.get("node_id"), rank)
    if not first:
        return
    ranks = list(first.values())
    whys = group.call(Actor.can_write, out.uri, ranks=ranks, timeout_s=run.call_timeout_s)
    bad = [(group.info[r], why) for r, why in zip(ranks, whys) if why]
    if bad:
        info, why = bad[0]
        n = len(bad) - 1
        more = f" (and {n} other node{'s' if n > 1 else ''})" if n else ""
        raise StorageError(
            f"checkpoints to {out.uri}: the actors on node {info.get('ip')} "
            f"({str(info.get('node_id'))[:8]}){more} cannot write there, though the driver can: {why}; "
            "every node that holds actors needs the storage's endpoint and credentials (a role that may "
            "write there, or AWS_* variables in the environment of each node's ray start); "
            + ("nothing was written" if not checked else
               f"the run stops: --resume {out.uri} continues it once they can"))
    checked.update(first)


def start(run: Any, group: ActorGroup, step: int, manifest: dict[str, Any], wait: bool = False,
          queued: bool = False) -> Place:
    """Begin the checkpoint of ``step`` steps (module docstring): ``queued``, its calls queued behind
    the step in flight and collected later (the actors not quiet), else waited for; with ``wait`` (or
    under ``RAYCONV_SYNC_CHECKPOINTS=1``) it is complete on return. Returns its folder."""
    out, ck = run.resolved.out, run.checkpoints
    if synchronous():
        settle(run, group)
        rank_files = group.call(Actor.rank_file, timeout_s=run.call_timeout_s)
        extra = {"metrics.parquet": run.metrics.to_bytes()}
        folder = write_checkpoint(out, step, rank_files, manifest, extra=extra, keep=run.cfg.keep_checkpoints)
        _logged(run, folder)
        return folder
    _drop_others(ck, group)
    r = route(run, group)
    folder = out / "checkpoints" / f"step-{step}"
    if ck.listed is None or step in ck.listed:   # (written again: emptied, its manifest first)
        try:
            remove(folder / "manifest.json")
            remove(folder)
        except OSError:
            pass   # (the storage unreachable: the actors' writes say so, in one line)
        if ck.listed is not None:
            ck.listed.discard(step)
    if isinstance(folder, Path):
        folder.mkdir(parents=True, exist_ok=True)
    world = len(group.actors)
    w = Writing(step, folder, manifest, group, world)
    w.started = group.submit_each(Actor.checkpoint_start, [(step, r.target(rank, folder))
                                                           for rank in range(world)])
    ck.open.append(w)
    if not queued:
        _collect_started(run, w)
    if wait:
        settle(run, group)
    return folder


def manifest_of(run: Any, step: int) -> dict[str, Any]:
    """What a checkpoint records besides the actors' rank files: model, layout, data and lr-schedule
    position, the settings (``--resume`` takes them over)."""
    cfg, s, mesh = run.cfg, run.resolved, run.resolved.mesh
    epoch, step_in_epoch = divmod(step, s.sharding.steps_per_epoch)
    return {
        "model": cfg.model, "num_classes": s.source.num_classes,
        "sample_shape": list(s.source.sample_shape), "precision": cfg.precision,
        "layout": {"dp": mesh.dp, "pp": mesh.pp, "fs": mesh.fs, "plan": cfg.plan,
                   "world_size": mesh.world_size, "stages": [list(st) for st in s.routing.stages],
                   "roles": [mesh.role(r) for r in range(mesh.world_size)]},
        "data": {"data": cfg.data, "next_step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                 "steps_per_epoch": s.sharding.steps_per_epoch, "seed": cfg.seed,
                 "global_batch_size": cfg.global_batch_size},
        "lr_schedule": {"schedule": cfg.lr_schedule, "lr": cfg.lr, "peak_lr": peak_lr(cfg),
                        "warmup_steps": warmup_steps(cfg, s.sharding.steps_per_epoch),
                        "total_steps": s.total_steps, "next_step": step,
                        "next_lr": learning_rate(cfg, step, s.total_steps, s.sharding.steps_per_epoch)
                        if step < s.total_steps else None},
        "config": s.saved_config().to_dict(),
        "written": datetime.now().isoformat(timespec="seconds"),
    }


def note(run: Any, results: list[dict[str, Any]]) -> None:
    """The poll, after a step's metrics are recorded: the ``saved`` results that came back with them,
    the ``checkpoint_start`` calls that returned (collected: a failure raised as any call's), and the
    checkpoints complete once every actor's result and their last step's metrics row are in."""
    ck: Checkpoints = run.checkpoints
    for x in results:
        for saved in x.get("saved", ()):
            _take(ck, saved)
    for w in ck.open:
        if w.started is not None and w.started.done():
            _collect_started(run, w)
    while ck.open and ck.open[0].reported and _rows_in(run, ck.open[0]):
        w = ck.open.pop(0)
        _collect_started(run, w)   # (returned: each actor's result came after it)
        _finish(run, w)


def settle(run: Any, group: Optional[ActorGroup], timeout_s: Optional[float] = None,
           quiet: bool = False) -> None:
    """Wait for the checkpoints being written (if ``group``'s actors write them) and complete them, in
    order; those being written by actors that are gone (a recovery) are dropped, their rank files removed
    after the next manifest. ``quiet``: a failure to wait (the actors stopped, ``timeout_s`` passed)
    drops them instead of raising (a run being stopped)."""
    ck: Checkpoints = run.checkpoints
    _drop_others(ck, group)
    if group is not None and not all(w.reported for w in ck.open):
        try:
            for w in ck.open:
                _collect_started(run, w, timeout_s)
            waited = group.call(Actor.checkpoint_wait, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - quiet: the run is stopping anyway
            if not quiet:
                raise
            waited, ck.open = [], []
        for results in waited:
            for saved in results:
                _take(ck, saved)
    while ck.open:
        w = ck.open.pop(0)
        _collect_started(run, w, timeout_s)   # (returned, where its results came: they follow it)
        if not w.errors and not _rows_in(run, w):
            w.errors.append(f"the metrics of step {w.step - 1} did not come back before the run stopped")
        _finish(run, w)
    if ck.completing is not None:
        ck.completing.join()
        ck.completing = None


def _drop_others(ck: Checkpoints, group: Optional[ActorGroup]) -> None:
    ck.open = [w for w in ck.open if w.group is group]


def _collect_started(run: Any, w: Writing, timeout_s: Optional[float] = None) -> None:
    if w.started is not None:
        started, w.started = w.started, None
        w.group.collect(started, timeout_s=run.call_timeout_s if timeout_s is None else timeout_s)


def _rows_in(run: Any, w: Writing) -> bool:
    """Whether the metrics row of the checkpoint's last step is in (it comes with the next step's call)."""
    last = run.metrics.last("train", "step")
    return last is not None and last >= w.step - 1


def _take(ck: Checkpoints, saved: dict[str, Any]) -> None:
    w = next((w for w in ck.open if w.step == saved["step"]), None)
    if w is None:
        return
    if "error" in saved:
        if saved["error"] not in w.errors:
            w.errors.append(saved["error"])
    else:
        for f in saved["files"]:
            w.results[f["name"]] = f


def _finish(run: Any, w: Writing) -> None:
    """``w``'s metrics rows taken (those of the steps before it, here on the driver's thread), its
    manifest written on a thread after the one before it (an fsync can wait behind the rank files' own
    writes to the same disk)."""
    ck: Checkpoints = run.checkpoints
    w.metrics = run.metrics.to_bytes(before=w.step)
    ck.completing = threading.Thread(target=_complete, args=(run, w, ck.completing),
                                     name=f"manifest-{w.step}", daemon=True)
    ck.completing.start()


def _complete(run: Any, w: Writing, before: Optional[threading.Thread] = None) -> None:
    """The manifest of ``w`` once every rank file is in (``metrics.parquet`` first) and the older rank
    files of checkpoints that never completed removed, or its failure's line; after ``before``."""
    if before is not None:
        before.join()
    out = run.resolved.out
    if not w.errors and len(w.results) < w.world_size:
        missing = w.world_size - len(w.results)
        w.errors.append(f"{missing} of the {w.world_size} actors' rank files were not reported")
    if not w.errors:
        try:
            files = [w.results[f"rank-{r}.pt"] for r in range(w.world_size)]
            write_manifest(w.folder, w.step, w.manifest, files, extra={"metrics.parquet": w.metrics})
            prune(out, run.cfg.keep_checkpoints)
            _logged(run, w.folder)
        except Exception as e:  # noqa: BLE001 - a storage error of any kind: the one line below
            w.errors.append(f"the manifest was not written ({type(e).__name__}: {str(e).strip()[:200]})")
        else:
            try:
                remove_partial(out, below=w.step)
            except OSError:
                pass   # (left for the next manifest, or the run's end)
            return
    newest = run.checkpoints.newest   # (the last this run completed: a failing store not listed)
    if newest is None:
        try:
            newest = latest_checkpoint(out)
        except OSError:
            pass
    run.log(f"rayconv: checkpoint of step {w.step} not written: {w.errors[0]}; the newest complete "
            f"checkpoint stays {describe(newest) if newest is not None else 'none'}")


def _logged(run: Any, folder: Place) -> None:
    run.checkpoints.newest = folder
    if not run.cfg.progress:
        run.log(f"checkpoint {describe(folder)}")

"""Checkpoints written by the actors, in the background; the driver writes each one's manifest, last.

At a checkpoint's step boundary (``start``) every actor copies what its rank file holds to host memory
(``Actor.checkpoint_start``: one copy of each tensor over the data-parallel replicas,
``outputs/rank_files.py``) and returns; training continues while each actor's background thread
serialises and writes ``rank-<r>.pt`` into ``<out>/checkpoints/step-<k>/`` (``actor/saver.py``). The
actors report each file's name, size and sha256 with a later step's metrics (``note``, the loop's poll)
or when asked (``settle``: before the next checkpoint, before the run's end, before a layout change or a
test hook); once all have, the driver writes ``metrics.parquet`` and then ``manifest.json`` (on a thread
of its own when the poll completes it, so that the step loop never waits on a disk), which alone makes
the checkpoint complete (``checkpoint.write_manifest``), and prunes to --keep-checkpoints. No tensor
passes through the driver. A write that failed (after the actors' retries) is one line; the previous
checkpoint stays the newest complete one and the rank files written are removed at the next checkpoint
(``checkpoint.remove_partial``), as are those a stopped run left.

Where the rank files go (``route``, said once on the console): a bucket, or a local ``--out`` on the
driver's disk, which actors on the driver's node write directly; an actor on another node (which may
not see that disk) streams its rank file through a writer on the driver's node (``cluster/sink.py``).

Before the first step of a run whose actors will write checkpoints into a store (``check_nodes``), one
actor on each node writes and deletes a probe object in the run's folder with its node's credentials
and endpoint: a node that cannot is one line naming it (exit status 2), before anything is written.

``RAYCONV_SYNC_CHECKPOINTS=1`` keeps the synchronous form (each actor's whole state through the driver,
written before training continues: format 1), for the benchmark's comparison
(``benchmarks/checkpoint_stall.py``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ray

from rayconv.actor.actor import Actor
from rayconv.cluster.group import ActorGroup
from rayconv.cluster.sink import SinkFolder, needs_sink, start_sink
from rayconv.outputs.checkpoint import (latest_checkpoint, prune, remove_partial, write_checkpoint,
                                        write_manifest)
from rayconv.storage import Location, Place, StorageError, describe, locate, remove

SYNC_ENV = "RAYCONV_SYNC_CHECKPOINTS"


@dataclass
class Writing:
    """A checkpoint the actors are writing: its step, folder, the manifest and metrics rows as of the
    step, the actor group writing it and the results in so far (file name -> result)."""

    step: int
    folder: Place
    manifest: dict[str, Any]
    metrics: bytes
    group: ActorGroup
    world_size: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


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


def route(run: Any, group: ActorGroup) -> Route:
    """How ``group``'s actors reach the run's checkpoints (module docstring), decided once per group
    and said on the console."""
    old = getattr(run, "ckpt_route", None)
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
    run.ckpt_route = r
    return r


def check_nodes(run: Any, group: ActorGroup) -> None:
    """Where ``group``'s actors will write checkpoints into a store (the run's folder is a store's
    URI, with --checkpoint-every or --elastic's preemption checkpoints): one actor on each node this run
    has not checked yet writes and deletes a probe object there (``Actor.can_write``), with its node's
    own environment. Raises StorageError, one line naming the node and what to change."""
    out, cfg = run.resolved.out, run.cfg
    if not isinstance(out, Location) or not (cfg.checkpoint_every or cfg.elastic is not None) \
            or os.environ.get(SYNC_ENV) == "1":
        return
    checked: set[str] = getattr(run, "nodes_checked", set())
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
    run.nodes_checked = checked | set(first)


def start(run: Any, group: ActorGroup, step: int, manifest: dict[str, Any], wait: bool = False) -> Place:
    """Begin the checkpoint of ``step`` steps (module docstring); with ``wait`` (or under
    ``RAYCONV_SYNC_CHECKPOINTS=1``) it is complete on return. Returns its folder."""
    settle(run, group)
    out = run.resolved.out
    if os.environ.get(SYNC_ENV) == "1":
        rank_files = group.call(Actor.rank_file, timeout_s=run.call_timeout_s)
        extra = {"metrics.parquet": run.metrics.to_bytes()}
        folder = write_checkpoint(out, step, rank_files, manifest, extra=extra, keep=run.cfg.keep_checkpoints)
        _logged(run, folder)
        return folder
    r = route(run, group)
    folder = out / "checkpoints" / f"step-{step}"
    try:   # (rank files of checkpoints that never completed; this step's, written again: its manifest first)
        remove(folder / "manifest.json")
        remove_partial(out)
        remove(folder)
    except OSError:
        pass   # (the storage unreachable: the actors' writes say so, in one line)
    if isinstance(folder, Path):
        folder.mkdir(parents=True, exist_ok=True)
    world = len(group.actors)
    group.call_each(Actor.checkpoint_start, [(step, r.target(rank, folder)) for rank in range(world)],
                    timeout_s=run.call_timeout_s)
    run.writing = Writing(step, folder, manifest, run.metrics.to_bytes(), group, world)
    if wait:
        settle(run, group)
    return folder


def note(run: Any, results: list[dict[str, Any]]) -> None:
    """The poll: the ``saved`` results that came back with a step's metrics; completes the checkpoint
    once every actor's is in."""
    w: Optional[Writing] = getattr(run, "writing", None)
    for x in results:
        saved = x.get("saved")
        if saved is not None and w is not None and saved["step"] == w.step:
            _take(w, saved)
    if w is not None and len(w.results) + len(w.errors) >= w.world_size:
        # (on a thread: an fsync of the manifest can wait behind the rank files' own writes to the same disk)
        run.writing = None
        run.completing = threading.Thread(target=_complete, args=(run, w), name=f"manifest-{w.step}",
                                          daemon=True)
        run.completing.start()


def settle(run: Any, group: Optional[ActorGroup], timeout_s: Optional[float] = None,
           quiet: bool = False) -> None:
    """Wait for the checkpoint being written (if ``group``'s actors write it) and complete it; one being
    written by actors that are gone (a recovery) is dropped, its rank files removed at the next checkpoint.
    ``quiet``: a failure to wait (the actors stopped, ``timeout_s`` passed) drops it instead of raising
    (a run being stopped)."""
    done: Optional[threading.Thread] = getattr(run, "completing", None)
    if done is not None:
        done.join()
        run.completing = None
    w: Optional[Writing] = getattr(run, "writing", None)
    if w is None:
        return
    if w.group is not group:
        run.writing = None
        return
    if len(w.results) + len(w.errors) < w.world_size:
        try:
            waited = group.call(Actor.checkpoint_wait, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - quiet: the run is stopping anyway
            if not quiet:
                raise
            run.writing = None
            return
        for saved in waited:
            if saved is not None and saved["step"] == w.step:
                _take(w, saved)
    run.writing = None
    _complete(run, w)


def _take(w: Writing, saved: dict[str, Any]) -> None:
    if "error" in saved:
        if saved["error"] not in w.errors:
            w.errors.append(saved["error"])
    else:
        for f in saved["files"]:
            w.results[f["name"]] = f


def _complete(run: Any, w: Writing) -> None:
    """The manifest of ``w`` once every rank file is in (``metrics.parquet`` first), or its failure's line."""
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
            return
        except Exception as e:  # noqa: BLE001 - a storage error of any kind: the one line below
            w.errors.append(f"the manifest was not written ({type(e).__name__}: {str(e).strip()[:200]})")
    newest = getattr(run, "ckpt_newest", None)   # (the last this run completed: a failing store not listed)
    if newest is None:
        try:
            newest = latest_checkpoint(out)
        except OSError:
            pass
    run.log(f"rayconv: checkpoint of step {w.step} not written: {w.errors[0]}; the newest complete "
            f"checkpoint stays {describe(newest) if newest is not None else 'none'}")


def _logged(run: Any, folder: Place) -> None:
    run.ckpt_newest = folder
    if not run.cfg.progress:
        run.log(f"checkpoint {describe(folder)}")

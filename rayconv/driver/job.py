"""The driver's outline: resolve -> start the actors -> the step loop -> finish, with recovery.

    resolved = resolve_run(cfg)                           # checks, data, model, layout, routing (resolve.py)
    with start_actors(run, ckpt) as actor_group:          # placement group, one actor per device, checkpoint
        train(run, actor_group, start)                    # one call per actor per step, two in flight (loop.py)
        return finish(run, actor_group)                   # model.pt, metrics.parquet, summary.json (finish.py)

With --evaluate-only the actors, once set up with --init's weights, evaluate them and the run ends
(``finish_evaluation``: metrics.parquet and summary.json, no training, no model.pt).

An actor lost mid-run (process or node died, collective timed out) ends the step for all; with
--max-failures F the driver then starts new actors, reloads the last checkpoint and continues (F times);
with --elastic MIN on the devices left, and back on the starting layout when they return (elastic.py).
Tensors of the training path never pass through the driver: it sends each actor its rank and the
routing once, then one small call per step.
"""

from __future__ import annotations

from typing import Any, Optional

from rayconv.actor.actor import Actor
from rayconv.cluster import across, pool
from rayconv.cluster.group import ActorGroup, start_group
from rayconv.config import Config
from rayconv.data.source import Sharding
from rayconv.driver import elastic
from rayconv.driver.early import REFUSALS, EarlyActors
from rayconv.driver.finish import export, finish, finish_evaluation, held_decode, recording_stop, writing_into
from rayconv.driver.loop import Run, train
from rayconv.driver.progress import kept_names, log_header
from rayconv.driver.resolve import call_timeout_s, resolve_run
from rayconv.errors import CallTimeout, ClusterError
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, rank_file_for
from rayconv.parallel.routing import Routing
from rayconv.signals import sigterm_as_interrupt
from rayconv.startup import claim, mark


def train_run(cfg: Config, log=print, on_step=None, on_eval=None, early: Optional[EarlyActors] = None) -> dict[str, Any]:
    """Train as ``cfg`` says; write config.json, metrics.parquet, summary.json and model.pt into the
    output folder (and checkpoints/ every ``cfg.checkpoint_every`` steps); return the summary.
    ``on_step(actor_group, step)``, if given, is called after each step (tests use it to inspect every actor);
    ``on_eval(row, total_steps)`` after each evaluation, with its metrics row (``step``, ``test_accuracy``,
    ... and the last ``train_loss``): raising ``errors.RunStopped`` there stops the run as Ctrl-C does.
    ``early``: the actors ``driver.prestart`` started before torch was imported (else they start once
    the layout is known, ``driver.early``).
    Raises ConfigError / DataError / LayoutError / CheckpointError before anything is written,
    ClusterError if an actor fails more than ``cfg.failure_budget`` times. A run stopped by Ctrl-C or
    SIGTERM after a step keeps its folder: config.json, metrics.parquet of the steps done, summary.json
    with ``status`` interrupted (``finish.record_stop``). On a failure the folder is removed if this run
    made it and it holds no result yet (a checkpoint or metrics.parquet); results are never deleted.
    """
    claim().mark("imports")                            # the start-up clock (rayconv.startup)
    early = early or EarlyActors()   # started once the layout is known, while the slower checks run (early.py)
    try:
        return _train(cfg, early, log, on_step, on_eval)
    except REFUSALS:
        early.keep(cfg.keep_actors_s)   # (unused: the corrected run of this process takes them)
        raise
    finally:
        early.kill()        # (any other failure before the run took them: nothing is left on the cluster)


def _train(cfg: Config, early: EarlyActors, log, on_step, on_eval) -> dict[str, Any]:
    resolved = resolve_run(cfg, log, on_layout=early.start, run_name=early.run_name)   # nothing written yet
    run = Run(resolved, log, on_step, on_eval)
    elastic.attach(run)                                # --elastic: re-plans after a loss, grows back (elastic.py)
    # SIGTERM stops the run as Ctrl-C does; a stop leaves the steps' metrics and a summary saying how
    # the run ended; on failure only results stay (checkpoints, metrics), not a bare config.json.
    with sigterm_as_interrupt(), writing_into(resolved.out, log), recording_stop(run):
        log_header(resolved, log)
        run.export = lambda actor_group, path: export(run, actor_group, path)   # (--keep-best's best/model.pt)
        ckpt, config_written = resolved.resume, False
        while True:
            try:
                # (Ctrl-C is recorded before the actors are stopped: that can wait on a cluster going down too)
                with start_actors(run, ckpt, early.take(run.resolved.mesh)) as actor_group, \
                        recording_stop(run, KeyboardInterrupt):
                    if not config_written:   # once the actors are set up: a failed start (a --resume in place
                        # among them) leaves the folder's config.json as it was; written whole (atomic)
                        resolved.saved_config().to_json(resolved.out / "config.json")
                        config_written = True
                    if resolved.cfg.evaluate_only:
                        return kept_after(run, actor_group, finish_evaluation(run, actor_group))
                    train(run, actor_group, start=ckpt.step if ckpt is not None else 0)
                    return kept_after(run, actor_group, finish(run, actor_group))
            except ClusterError as e:   # the checkpoint to continue from (--elastic: on the layout it picks), or raises
                ckpt = run.elastic.recover(e, run, recover_or_raise) if run.elastic else recover_or_raise(e, run)


def kept_after(run: Run, actor_group: ActorGroup, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary``, once the actors of the run that ended are kept (--keep-actors-s) instead of stopped:
    on the cluster for the next command where they may outlive this one (``cluster.across``), else for
    the next run of this process (``cluster.pool``)."""
    if across.enabled():
        n = len(actor_group.actors)
        if across.leave(actor_group, run.cfg.keep_actors_s):
            run.log(f"rayconv: {n} actors stay on the cluster for {run.cfg.keep_actors_s:g} s, for the next command "
                    "that needs them (--keep-actors-s 0: stopped at the end instead)")
    else:
        pool.keep(actor_group, actor_group.key, run.cfg.keep_actors_s)
    return summary


def start_actors(run: Run, ckpt: Optional[Checkpoint], started: Optional[ActorGroup] = None) -> ActorGroup:
    """Start the actors (within --max-wait; ``started``: those started early, ``driver.early``), set them
    up under the run's resolved settings and load ``ckpt`` (and its metrics rows) if given. Raises
    ClusterError; the actors are stopped on any failure."""
    s = run.resolved
    actor_group = started if started is not None else start_group(Actor, s.cfg, s.mesh, s.run_name, timeout_s=s.cfg.max_wait)
    try:
        actor_group.wait_started()
        mark("actors_alive")
        if actor_group.across:
            run.log(f"rayconv: {len(actor_group.actors)} actors kept on the cluster by a previous command, reused "
                    f"(--keep-actors-s){kept_names(actor_group.names, s.run_name)}")
        elif actor_group.reused:
            n, spare = len(actor_group.actors), len(actor_group.spare)
            line = (f"rayconv: {n} actors kept from this process's previous run, reused (--keep-actors-s)"
                    if not spare else f"rayconv: {n} of the {n + spare} actors kept from this process's "
                    f"previous run, reused; the other {spare} wait in its placement group until this run "
                    "ends (--keep-actors-s 0: not kept)")
            run.log(line + kept_names(actor_group.names, s.run_name))
        change_mark = run.elastic.mark if run.elastic else (lambda phase: None)   # (a change's phases)
        change_mark("actors_alive")
        run.actor_reports = build_actors(actor_group, s.mesh, s.routing, s.sharding, run.call_timeout_s, s.cfg)
        mark("actors_set_up")
        change_mark("actors_set_up")
        run.startup.mark_actors(run.actor_reports)
        decode = held_decode(run.actor_reports)
        if decode is not None:
            run.log(f"rayconv: {'read' if s.cfg.raw_pixels else 'decoded'} {decode['decoded_images']} images in "
                    f"{decode['decode_s']:.1f} s on {decode['decode_workers']} workers (data held on the device; "
                    "before the first step)")
        run.continue_from(ckpt)
        if ckpt is not None:
            actor_group.call_each("load_rank_file", [(rank_file_for(ckpt, s.mesh, r), ckpt.step) for r in range(s.mesh.world_size)],
                           timeout_s=run.call_timeout_s)
            change_mark("checkpoint_loaded")
    except BaseException:
        actor_group.kill()
        raise
    return actor_group


def build_actors(actor_group: ActorGroup, mesh: Mesh, routing: Routing, sharding: Sharding, timeout_s: float,
                 cfg: Optional[Config] = None) -> list[dict[str, Any]]:
    """Each actor's ``build``: process groups (rank 0's address the rendezvous), its part of the model
    cut from the routing, the optimizer, the train sharding it reads by, under ``cfg`` (None: the
    settings the actors were started with). Returns their reports in rank order."""
    master = actor_group.call("open_rendezvous", ranks=[0], timeout_s=timeout_s)[0]
    settings = None if cfg is None else cfg.to_dict()
    return actor_group.call_each("build", [(r, master, routing, sharding, settings) for r in range(mesh.world_size)],
                                 timeout_s=timeout_s)


def launch(cfg: Config, mesh: Mesh, routing: Routing, sharding: Sharding, run_name: str,
           timeout_s: float = 120.0) -> tuple[ActorGroup, list[dict[str, Any]]]:
    """Start the actors of ``cfg`` (resolved, with mesh, routing and sharding as ``resolve.resolve_on_cluster`` returns
    them) and set them up, for a caller with its own step loop (the bench). Returns (actor_group, setup
    reports). Raises ClusterError."""
    actor_group = start_group(Actor, cfg, mesh, run_name, timeout_s=timeout_s)
    try:
        return actor_group, build_actors(actor_group, mesh, routing, sharding, call_timeout_s(cfg))
    except BaseException:
        actor_group.kill()
        raise


def recover_or_raise(e: ClusterError, run: Run) -> Optional[Checkpoint]:
    """After the actors failed with ``e`` (and were stopped): the checkpoint to continue from (the
    run's newest, else the one it resumed from, else None: the start), counted against --max-failures
    (``Config.failure_budget``: no limit by default with --elastic). A loss after the last step (during
    the final export) continues from the last step's checkpoint:
    the new actors load it and export. Raises ``e`` when it is not recoverable or when no failures
    are left."""
    if isinstance(e, CallTimeout):
        e = CallTimeout(f"{e}; the limit is 2 x --collective-timeout-s + 30 s: raise "
                        "--collective-timeout-s if the work is only slow", recoverable=True)
    budget = run.cfg.failure_budget   # (-1: no limit; --elastic's default)
    if not e.recoverable:
        raise e from None
    if 0 <= budget <= run.failures:
        raise type(e)(f"{e}; {run.failures} of --max-failures {budget} recovered: give --max-failures N "
                      "(-1: no limit) with --checkpoint-every to recover from more", True) from None
    run.failures += 1
    latest = latest_checkpoint(run.resolved.out)
    ckpt = load_checkpoint(latest) if latest is not None else run.resolved.resume
    of = "no limit" if budget < 0 else f"{budget}"
    run.log(f"rayconv: {e}\nrayconv: recovering ({run.failures} of --max-failures {of}): "
            f"new actors, continuing from {ckpt.path if ckpt else 'the start'}")
    return ckpt

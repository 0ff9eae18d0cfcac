"""The driver's outline: setup -> start the actors -> the step loop -> finish, with recovery.

    setup = setup_run(cfg)                            # checks, data, model, layout, routing plan (setup.py)
    with start_actors(run, ckpt) as gang:             # placement group, one actor per device, checkpoint
        train(run, gang, start)                       # one call per actor per step, two in flight (loop.py)
        return finish(run, gang)                      # model.pt, metrics.parquet, summary.json (finish.py)

With --evaluate-only the actors, once set up with --init's weights, evaluate them and the run ends
(``finish_evaluation``: metrics.parquet and summary.json, no training, no model.pt).

An actor lost mid-run (process or node died, collective timed out) ends the step for all; with
--max-failures F the driver then starts new actors, reloads the last checkpoint and continues (F times).
Tensors of the training path never pass through the driver: it sends each actor its rank and the
routing plan once, then one small call per step.
"""

from __future__ import annotations

from typing import Any, Optional

from rayconv.actor.worker import Worker
from rayconv.cluster.group import Gang, start_workers
from rayconv.config import Config
from rayconv.driver.finish import finish, finish_evaluation, startup, writing_into
from rayconv.driver.loop import Run, train
from rayconv.driver.progress import log_header
from rayconv.driver.setup import call_timeout_s, setup_run
from rayconv.errors import CallTimeout, ClusterError
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, shard_for
from rayconv.parallel.layout_plan import LayoutPlan


def fit(cfg: Config, log=print, on_step=None) -> dict[str, Any]:
    """Train as ``cfg`` says; write config.json, metrics.parquet, summary.json and model.pt into the
    output folder (and checkpoints/ every ``cfg.checkpoint_every`` steps); return the summary.
    ``on_step(gang, step)``, if given, is called after each step (tests use it to inspect every actor).
    Raises ConfigError / DataError / PlanError / CheckpointError before anything is written,
    ClusterError if an actor fails more than ``cfg.max_failures`` times. On failure the output folder
    is removed if this run made it and it holds no checkpoint; checkpoints are never deleted.
    """
    setup = setup_run(cfg, log)                   # nothing written yet; the settings resolved
    with writing_into(setup.out, log):            # on failure only checkpoints (and config.json) stay
        setup.saved_config().to_json(setup.out / "config.json")
        log_header(setup, log)
        run = Run(setup, log, on_step)
        ckpt = setup.resume
        while True:
            try:
                with start_actors(run, ckpt) as gang:
                    if setup.cfg.evaluate_only:
                        return finish_evaluation(run, gang)
                    train(run, gang, start=ckpt.step if ckpt is not None else 0)
                    return finish(run, gang)
            except ClusterError as e:
                ckpt = recover_or_raise(e, run)   # the checkpoint to continue from, or raises


def start_actors(run: Run, ckpt: Optional[Checkpoint]) -> Gang:
    """Start the actors (within --max-wait), set them up and load ``ckpt`` (and its metrics rows) if
    given. Raises ClusterError; the actors are stopped on any failure."""
    s = run.setup
    gang = start_workers(Worker, s.cfg, s.mesh, s.run_name, timeout_s=s.cfg.max_wait)
    try:
        run.setups = set_up(gang, s.mesh, s.plan, run.call_timeout_s)
        decode = startup(run.setups)
        if decode is not None:
            run.log(f"rayconv: decoded {decode['decoded_images']} images in {decode['decode_s']:.1f} s on "
                    f"{decode['decode_workers']} workers (data held on the device; before the first step)")
        run.continue_from(ckpt)
        if ckpt is not None:
            gang.call_each("load_shard", [(shard_for(ckpt, s.mesh, r), ckpt.step) for r in range(s.mesh.world_size)],
                           timeout_s=run.call_timeout_s)
    except BaseException:
        gang.kill()
        raise
    return gang


def set_up(gang: Gang, mesh: Mesh, plan: LayoutPlan, timeout_s: float) -> list[dict[str, Any]]:
    """Each actor's ``setup``: process groups (rank 0's address the rendezvous), its part of the model
    cut from the routing plan, the optimizer. Returns their reports in rank order."""
    master = gang.call("free_address", ranks=[0], timeout_s=timeout_s)[0]
    return gang.call_each("setup", [(r, master, plan) for r in range(mesh.world_size)], timeout_s=timeout_s)


def launch(cfg: Config, mesh: Mesh, plan: LayoutPlan, run_name: str,
           timeout_s: float = 120.0) -> tuple[Gang, list[dict[str, Any]]]:
    """Start the actors of ``cfg`` (resolved, as ``setup.prepare`` returns it) and set them up, for a
    caller with its own step loop (the bench). Returns (gang, setup reports). Raises ClusterError."""
    gang = start_workers(Worker, cfg, mesh, run_name, timeout_s=timeout_s)
    try:
        return gang, set_up(gang, mesh, plan, call_timeout_s(cfg))
    except BaseException:
        gang.kill()
        raise


def recover_or_raise(e: ClusterError, run: Run) -> Optional[Checkpoint]:
    """After the actors failed with ``e`` (and were stopped): the checkpoint to continue from (the
    run's newest, else the one it resumed from, else None: the start), counted against --max-failures.
    Raises ``e`` when it is not recoverable, when no failures are left, or when every step was done."""
    if run.trained:  # the export failed: the steps are done, a restart would not help
        raise e
    if isinstance(e, CallTimeout):
        e = CallTimeout(f"{e}; the limit is 2 x --collective-timeout-s + 30 s: raise "
                        "--collective-timeout-s if the work is only slow", recoverable=True)
    if not e.recoverable or run.failures >= run.cfg.max_failures:
        raise e from None
    run.failures += 1
    latest = latest_checkpoint(run.setup.out)
    ckpt = load_checkpoint(latest) if latest is not None else run.setup.resume
    run.log(f"rayconv: {e}\nrayconv: recovering ({run.failures} of --max-failures {run.cfg.max_failures}): "
            f"new actors, continuing from {ckpt.path if ckpt else 'the start'}")
    return ckpt

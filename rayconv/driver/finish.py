"""The end of a run: ``model.pt`` (and ``model_ema.pt`` with ``--model-ema``), ``metrics.parquet`` and
``summary.json`` in the output folder (``finish_evaluation``: of an --evaluate-only run, the last two);
and what a stopped run leaves there (``record_stop``, ``writing_into``): its checkpoints, config.json,
and the metrics of its steps with a summary whose ``status`` says how it ended; or nothing, when it
stopped before it had anything to show.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from rayconv.actor.actor import Actor
from rayconv.cluster.group import ActorGroup
from rayconv.driver.loop import Run, evaluate, export
from rayconv.errors import ConfigError, RunStopped, first_line
from rayconv.files import write_json
from rayconv.outputs.checkpoint import list_checkpoints, remove_partial
from rayconv.planner.search import compare
from rayconv.signals import stopped_by
from rayconv.startup import after
from rayconv.storage import Place, StorageError, describe, remove


def finish(run: Run, actor_group: ActorGroup) -> dict[str, Any]:
    """Write model.pt (a plain state_dict of the whole model; model_ema.pt, the moving average's, with
    --model-ema), metrics.parquet and summary.json into the output folder; return the summary. Raises
    ClusterError when an actor fails meanwhile."""
    out = run.resolved.out
    export(run, actor_group, out / "model.pt")
    if run.cfg.model_ema:
        export(run, actor_group, out / "model_ema.pt", ema=True)
    run.changes.settle(run.log)   # (a layout change after a loss during the export: its line and row now)
    memory = actor_group.call(Actor.memory, timeout_s=run.call_timeout_s)
    run.metrics.write(out / "metrics.parquet")
    summary = summarize(run, memory)
    write_json(out / "summary.json", summary)
    run.log(done_line(summary, out))
    planner = summary.get("planner") or {}
    predicted, measured = planner.get("predicted_images_per_s"), planner.get("measured_images_per_s")
    if predicted and measured:   # the planner's error
        run.log(f"--layout auto: predicted {predicted:.0f} images/s, measured {measured:.0f} "
                f"({measured / predicted:.2f}x the prediction; summary.json's planner)")
    return summary


def done_line(summary: dict[str, Any], out: Place) -> str:
    """The line a finished run ends with: final train loss, test accuracy, images/s ("n/a" where the
    run has none: no step timed, no evaluation), wall time (from the run's checks, and from the command
    where the start-up clock says), the output folder."""
    st = summary.get("startup") or {}
    since = (f", ended {st['ended']:.1f} s {after(st.get('origin', ''))}" if st.get("ended") is not None
             else "")
    return (f"done: train loss {_fmt(summary['final_train_loss'], '.4f')}, test accuracy "
            f"{_fmt(summary['test_accuracy'], '.4f')}, {_fmt(summary['images_per_s'], '.0f')} images/s, "
            f"run {summary['wall_time_s']:.1f} s{since} -> {out}")


def _fmt(value: Optional[float], spec: str) -> str:
    """``value`` formatted by ``spec``, or "n/a" (no step timed, no evaluation)."""
    return "n/a" if value is None else format(value, spec)


def finish_evaluation(run: Run, actor_group: ActorGroup) -> dict[str, Any]:
    """--evaluate-only: the actors evaluate --init's weights once (test loss, top-1, top-5); write
    metrics.parquet (one ``eval`` row at step 0) and summary.json (``steps`` 0); return the summary.
    Raises ClusterError when an actor fails."""
    out, cfg = run.resolved.out, run.cfg
    t0 = time.perf_counter()
    if cfg.precise_bn_batches:   # (--init's statistics recomputed over the first training batches)
        actor_group.call(Actor.recalibrate_bn, 0, timeout_s=run.call_timeout_s)
    run.last_eval = evaluate(actor_group, run.call_timeout_s)
    run.metrics.add(kind="eval", step=0, epoch=0, time_s=time.perf_counter() - t0, **run.last_eval)
    run.metrics.write(out / "metrics.parquet")
    summary = summarize(run, actor_group.call(Actor.memory, timeout_s=run.call_timeout_s))
    write_json(out / "summary.json", summary)
    run.log(f"evaluated --init {cfg.init}: test top-1 {summary['test_accuracy']:.4f}, top-5 "
            f"{_fmt(summary['test_top5_accuracy'], '.4f')}, test loss {summary['test_loss']:.4f} -> {out}")
    return summary


def held_decode(setups: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The one-time decode of data held on the device, from the actors' build reports (the slowest
    actor's ``decode_s``, its images and workers; merged into summary.json's ``startup``), None when
    nothing was held."""
    held = [r["data_decode"] for r in setups if r.get("data_decode")]
    if not held:
        return None
    slowest = max(held, key=lambda d: d["decode_s"])
    return {"decode_s": slowest["decode_s"], "decoded_images": slowest["images"],
            "decode_workers": slowest["workers"]}


def summarize(run: Run, memory: list[dict[str, Any]], status: str = "finished") -> dict[str, Any]:
    """summary.json: ``status`` (finished, interrupted or failed) and ``steps_done`` (the steps trained,
    of ``steps``), the layout, the final loss and test figures (``ema_test_accuracy`` of the moving
    average, null without --model-ema), images/s, input stall, times, the time to --target-accuracy
    (``driver.target``), the weights it started from (``init``; ``evaluate_only``), and per actor its setup
    report and peak memory (``memory``: one per rank)."""
    cfg, s, mesh = run.cfg, run.resolved, run.resolved.mesh
    train_rows = [row for row in run.metrics.rows if row["kind"] == "train"]
    stall_ms = sum(x.get("input_stall_ms") or 0.0 for x in train_rows)
    own_ms = sum(x["step_ms"] or 0.0 for x in train_rows)
    ev = run.last_eval
    summary = {
        "status": status,
        "steps_done": train_rows[-1]["step"] + 1 if train_rows else (s.resume.step if s.resume else 0),
        "model": cfg.model, "data": cfg.data, "device": cfg.device,
        "input_shape": list(s.source.sample_shape),   # (C, S, S) the model was built for and trained on
        "data_dir": s.data_dir, "stage_dir": cfg.stage_dir,   # the folder given; its --stage-dir copy, read
        "layout": {"dp": mesh.dp, "pp": mesh.pp, "fs": mesh.fs, "world_size": mesh.world_size,
                   "plan": cfg.plan, "schedule": cfg.schedule if mesh.pp > 1 else None,
                   "num_microbatches": cfg.num_microbatches, "virtual_stages": cfg.virtual_stages,
                   "exchange_chunks": cfg.exchange_chunks if mesh.fs > 1 else None,
                   "stages": [list(st) for st in s.routing.stages]},
        "global_batch_size": cfg.global_batch_size, "steps": 0 if cfg.evaluate_only else s.total_steps,
        "epochs": 0.0 if cfg.evaluate_only else s.total_steps / s.sharding.steps_per_epoch,
        "init": cfg.init, "evaluate_only": cfg.evaluate_only,
        "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
        "test_accuracy": ev.get("test_accuracy"), "test_error": ev.get("test_error"),
        "test_loss": ev.get("test_loss"), "test_top5_accuracy": ev.get("test_top5_accuracy"),
        "ema_test_accuracy": ev.get("ema_test_accuracy"),
        "val_split": cfg.val_split, "val_accuracy": ev.get("val_accuracy"), "val_loss": ev.get("val_loss"),
        "val_top5_accuracy": ev.get("val_top5_accuracy"), **run.best.summary(),
        "images_per_s": run.images_per_s(),
        # The steps' waits for input not overlapped with compute, summed, and their share of the steps' time.
        "input_stall_s": stall_ms / 1e3, "input_stall_fraction": stall_ms / own_ms if own_ms > 0 else None,
        "train_time_s": run.train_s, "wall_time_s": time.perf_counter() - s.t_start,
        # seconds since the command to each start-up phase (rayconv.startup); with data held on the device,
        # its one-time decode (decode_s, decoded_images, decode_workers)
        "startup": {**run.startup.record(), "ended": round(run.startup.elapsed(), 4),
                    **(held_decode(run.actor_reports) or {})},
        **run.target.summary(run.wall),
        "run_name": s.run_name, "out": describe(s.out),   # (a URI as given: none carries a secret)
        "resumed_from": str(s.resume.path) if s.resume is not None else None,
        "failures_recovered": run.failures,
        "layout_changes": run.layout_changes,   # --elastic: step, from, to, why, seconds_lost, steps_redone
        "actors": [{**report, **m} for report, m in zip(run.actor_reports, memory)],
    }
    if s.predicted is not None and status == "finished":
        summary["planner"] = compare(s.predicted, summary)
    return summary


def record_stop(run: Run, e: BaseException) -> None:
    """A run stopped by ``e`` before its end: its ``metrics.parquet`` (every step so far) and a
    ``summary.json`` whose ``status`` is ``interrupted`` (KeyboardInterrupt: Ctrl-C, or SIGTERM under
    ``signals.sigterm_as_interrupt``; ``signal`` says which; a caller's ``RunStopped``: ``stopped_by``) or
    ``failed`` (with ``error``), once this process trained a step; a failure only into a folder that already
    holds results (metrics.parquet or a checkpoint), which ``writing_into`` keeps. What it cannot write is
    said, not raised: ``e`` is what the caller reports."""
    out, interrupted = run.resolved.out, isinstance(e, KeyboardInterrupt)
    if not run.wall or not (interrupted or (out / "metrics.parquet").exists() or list_checkpoints(out)):
        return
    try:
        run.metrics.write(out / "metrics.parquet")
        summary = summarize(run, [], status="interrupted" if interrupted else "failed")
        if isinstance(e, RunStopped):
            summary["stopped_by"] = str(e)
        elif interrupted:
            summary["signal"] = stopped_by()
        else:
            summary["error"] = first_line(e)
        write_json(out / "summary.json", summary)
    except Exception as err:  # (a full disk: the run's own error is the one to report)
        run.log(f"rayconv: could not record the stopped run in {out}: {err}")


@contextmanager
def recording_stop(run: Run, only: type = BaseException) -> Iterator[None]:
    """For the body: an exception of type ``only`` that stops the run is recorded (``record_stop``,
    once per run however many of these it passes through), then raised on."""
    try:
        yield
    except only as e:
        if not run.stop_recorded:
            run.stop_recorded = True
            record_stop(run, e)
        raise


@contextmanager
def events_closed(run: Run) -> Iterator[None]:
    """TensorBoard's event files closed when the body ends, however it ends (for ``--out`` in a store:
    uploaded, the local copy removed), after a stop's last rows (``recording_stop`` inside it) and before
    the output folder's own clean-up (``writing_into`` around it); not left to the run object's garbage
    collection, which a traceback holding the run delays. A failed last upload is one line, not the run's
    failure: metrics.parquet holds the same rows."""
    try:
        yield
    finally:
        try:
            run.events.close()
        except StorageError as e:
            run.log(f"rayconv: TensorBoard's event files not all written: {e}")


@contextmanager
def writing_into(out: Place, log=print) -> Iterator[Place]:
    """Make the output folder ``out`` (a Path, or a ``storage.Location``: a prefix in a store) for the
    body. If the body raises, nothing half-written stays
    behind, but results are never deleted: a folder holding a checkpoint (to resume from) or
    metrics.parquet (the steps' record) keeps everything; otherwise (config.json at most: the
    settings, which the same command gives again) the folder is removed (if made here) or emptied,
    so that the same ``--out`` can be given again."""
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # (checked before Ray: storage_checks.check_writable; a mount may turn read-only)
        raise ConfigError(f"--out {out} cannot be made ({e.strerror or type(e).__name__}): choose a folder "
                          "you can write to") from None
    try:
        yield out
    except BaseException:
        remove_partial(out)
        if list_checkpoints(out) or (out / "metrics.parquet").exists():
            pass
        elif made:
            remove(out)
            log(f"rayconv: {out} removed: the run stopped before any result or checkpoint was written")
        else:  # the folder was empty when this run began
            for p in out.iterdir():
                remove(p)
            log(f"rayconv: {out} left empty: the run stopped before any result or checkpoint was written")
        raise

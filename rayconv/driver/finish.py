"""The end of a run: ``model.pt`` (and ``model_ema.pt`` with ``--model-ema``), ``metrics.parquet`` and
``summary.json`` in the output folder (``finish_evaluation``: of an --evaluate-only run, the last two);
and what a failed run leaves there (its checkpoints and config.json, or nothing).
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from rayconv.cluster.group import Gang
from rayconv.driver.loop import Run, evaluate
from rayconv.files import write_json
from rayconv.models import run_model
from rayconv.outputs.checkpoint import list_checkpoints, remove_partial
from rayconv.outputs.export import assemble, export_model
from rayconv.planner.search import compare


def finish(run: Run, gang: Gang) -> dict[str, Any]:
    """Write model.pt (a plain state_dict of the whole model; model_ema.pt, the moving average's, with
    --model-ema), metrics.parquet and summary.json into the output folder; return the summary. Raises
    ClusterError when an actor fails meanwhile."""
    out = run.setup.out
    export(run, gang, out / "model.pt")
    if run.cfg.model_ema:
        export(run, gang, out / "model_ema.pt", ema=True)
    memory = gang.call("memory", timeout_s=run.call_timeout_s)
    run.metrics.write(out / "metrics.parquet")
    summary = summarize(run, memory)
    write_json(out / "summary.json", summary)
    run.log(f"done: train loss {summary['final_train_loss']:.4f}, test accuracy {summary['test_accuracy']:.4f}, "
            f"{summary['images_per_s']:.0f} images/s, {summary['wall_time_s']:.1f} s -> {out}")
    return summary


def finish_evaluation(run: Run, gang: Gang) -> dict[str, Any]:
    """--evaluate-only: the actors evaluate --init's weights once (test loss, top-1, top-5); write
    metrics.parquet (one ``eval`` row at step 0) and summary.json (``steps`` 0); return the summary.
    Raises ClusterError when an actor fails."""
    out, cfg = run.setup.out, run.cfg
    t0 = time.perf_counter()
    run.last_eval = evaluate(gang, run.call_timeout_s)
    run.metrics.add(kind="eval", step=0, epoch=0, time_s=time.perf_counter() - t0, **run.last_eval)
    run.metrics.write(out / "metrics.parquet")
    summary = summarize(run, gang.call("memory", timeout_s=run.call_timeout_s))
    write_json(out / "summary.json", summary)
    top5 = summary["test_top5_accuracy"]
    run.log(f"evaluated --init {cfg.init}: test top-1 {summary['test_accuracy']:.4f}, top-5 "
            f"{'n/a' if top5 is None else f'{top5:.4f}'}, test loss {summary['test_loss']:.4f} -> {out}")
    return summary


def export(run: Run, gang: Gang, path: Path, ema: bool = False) -> None:
    """``path`` <- the actors' parts (``ema``: of their moving averages) assembled into one state_dict,
    loaded into a fresh model to check it, written atomically."""
    cfg, mesh = run.cfg, run.setup.mesh
    # Replica 0's actors hold the whole model between them.
    # (Under the per-layer plan every actor holds a slice of the FC layers.)
    holders = list(range(mesh.world_size)) if cfg.plan != "none" else \
        [mesh.rank((0, p, f)) for p in range(mesh.pp) for f in range(mesh.fs)]
    states = gang.call("state", *((True,) if ema else ()), ranks=holders, timeout_s=run.call_timeout_s)
    split_dims: dict[str, int] = {}
    for d in gang.call("split_dims", ranks=holders, timeout_s=run.call_timeout_s):
        split_dims.update(d)
    export_model(path, assemble(states, split_dims), run_model(cfg, run.setup.source))


def startup(setups: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """summary.json's ``startup`` from the actors' setup reports: the one-time decode of data held on
    the device (the slowest actor's ``decode_s``, its images and workers), None when nothing was held."""
    held = [r["data_decode"] for r in setups if r.get("data_decode")]
    if not held:
        return None
    slowest = max(held, key=lambda d: d["decode_s"])
    return {"decode_s": slowest["decode_s"], "decoded_images": slowest["images"], "decode_workers": slowest["workers"]}


def summarize(run: Run, memory: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json: the layout, the final loss and test figures (``ema_test_accuracy`` of the moving
    average, null without --model-ema), images/s, input stall, times, the time to --target-accuracy
    (``driver.target``), the weights it started from (``init``; ``evaluate_only``), and per actor its setup report and peak memory (``memory``: one per rank)."""
    cfg, s, mesh = run.cfg, run.setup, run.setup.mesh
    train_rows = [row for row in run.metrics.rows if row["kind"] == "train"]
    stall_ms = sum(x.get("input_stall_ms") or 0.0 for x in train_rows)
    own_ms = sum(x["step_ms"] or 0.0 for x in train_rows)
    ev = run.last_eval
    summary = {
        "model": cfg.model, "data": cfg.data, "device": cfg.device,
        "input_shape": list(s.source.sample_shape),   # (C, S, S) the model was built for and trained on
        "data_dir": s.data_dir, "stage_dir": cfg.stage_dir,   # the folder given; its --stage-dir copy, read
        "layout": {"dp": mesh.dp, "pp": mesh.pp, "fs": mesh.fs, "world_size": mesh.world_size,
                   "plan": cfg.plan, "schedule": cfg.schedule if mesh.pp > 1 else None,
                   "num_microbatches": cfg.num_microbatches, "virtual_stages": cfg.virtual_stages,
                   "exchange_chunks": cfg.exchange_chunks if mesh.fs > 1 else None,
                   "stages": [list(st) for st in s.plan.stages]},
        "global_batch_size": cfg.global_batch_size, "steps": 0 if cfg.evaluate_only else s.total_steps,
        "epochs": 0.0 if cfg.evaluate_only else s.total_steps / s.sharding.steps_per_epoch,
        "init": cfg.init, "evaluate_only": cfg.evaluate_only,
        "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
        "test_accuracy": ev.get("test_accuracy"), "test_error": ev.get("test_error"),
        "test_loss": ev.get("test_loss"), "test_top5_accuracy": ev.get("test_top5_accuracy"),
        "ema_test_accuracy": ev.get("ema_test_accuracy"),
        "images_per_s": run.images_per_s(),
        # The steps' waits for input not overlapped with compute, summed, and their share of the steps' time.
        "input_stall_s": stall_ms / 1e3, "input_stall_fraction": stall_ms / own_ms if own_ms > 0 else None,
        "train_time_s": run.train_s, "wall_time_s": time.perf_counter() - s.t_start,
        "startup": startup(run.setups),   # the one-time decode of data held on the device (None: none held)
        **run.target.summary(run.wall),
        "run_name": s.run_name,
        "resumed_from": str(s.resume.path) if s.resume is not None else None, "failures_recovered": run.failures,
        "actors": [{**setup, **m} for setup, m in zip(run.setups, memory)],
    }
    if s.predicted is not None:
        summary["planner"] = compare(s.predicted, summary)
    return summary


@contextmanager
def writing_into(out: Path, log=print) -> Iterator[Path]:
    """Make the output folder ``out`` for the body. If the body raises, nothing half-written stays
    behind, but checkpoints are never deleted: a folder holding one keeps it (and config.json) so that
    the run can be resumed; otherwise the folder is removed (if made here) or emptied."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:
        remove_partial(out)
        if list_checkpoints(out):
            pass
        elif made:
            shutil.rmtree(out, ignore_errors=True)
            log(f"rayconv: {out} removed: the run stopped before any result or checkpoint was written")
        else:  # the folder was empty when this run began
            for p in out.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            log(f"rayconv: {out} left empty: the run stopped before any result or checkpoint was written")
        raise

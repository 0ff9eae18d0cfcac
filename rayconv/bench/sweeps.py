"""The bench's loops over layouts: the layout table (``main_bench``: each layout measured, beside the
anchors), the batch and memory sweeps (``sweep_batch``) and the training curve (``training_curve``).

A layout that fails (out of memory, an actor's error, a call past ``--call-timeout-s``) keeps its
row, with nulls where nothing was measured and ``note`` naming the phase and the error; the loop
goes on with the next layout. Rows are written after each layout (or batch), so that a run cut
short keeps what it measured. ``args.out`` is where they go: a ``storage.Place`` (a folder, or a
``storage.Location`` in a store), each file whole or absent.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from rayconv.bench.anchor import run_anchor
from rayconv.bench.measure import base_config, measure
from rayconv.bench.table import write_table
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.errors import ClusterError, first_line
from rayconv.files import atomic_write
from rayconv.layout import Layout
from rayconv.outputs.charts import error_against_time
from rayconv.outputs.metrics import read_rows
from rayconv.storage import place, remove

PP_MICROBATCH_TRIES = (2, 4, 8)  # a pipeline named without micro-batches (pp2): each tried, the fastest kept


def main_bench(args) -> list[dict[str, Any]]:
    """One row per (model, global batch, layout) of ``args``, each compared with the anchors; the
    rows are written to ``args.out`` after every layout (``bench.table.write_table``)."""
    out = args.out
    rows: list[dict[str, Any]] = []
    jobs = [(m, b, name) for m in args.models.split(",") for b in args.global_batch_size
            for name in args.layouts.split(",")]
    # logs: RESULT lines
    bar = tqdm(total=len(jobs), desc="bench", unit="layout", disable=not sys.stderr.isatty())
    single: dict[tuple[str, int], float] = {}
    anchors: dict[tuple[str, int, int], Optional[dict[str, Any]]] = {}
    for model, gb, name in jobs:
        bar.set_postfix_str(f"{model} {name} B={gb}")
        lay = Layout.parse(name)
        row: dict[str, Any] = {"model": model, "layout": name, "global_batch_size": gb,
                               "image_size": args.image_size, "data": args.data, "note": "",
                               "world_size": lay.world_size}
        best = _fastest(args, model, name, lay, gb, row)
        if best is not None:
            row.update(best)
            if lay.world_size == 1:
                single[(model, gb)] = best["images_per_s"]
        _compare(args, row, lay.world_size, single, anchors)
        rows.append(row)
        write_table(rows, out)  # after every layout: a cut-short run keeps what it measured
        ips = row.get("images_per_s")
        first = row.get("to_first_step_s")
        first = "n/a" if first is None else f"{first:.1f} s"
        print(f"RESULT {model} {name} B={gb}: " + (f"{ips:.0f} images/s, first step {first} after its start, "
              f"speedup {ratio(row['speedup_vs_1'])}, "
              f"vs plain {ratio(row['vs_plain_pytorch'])}, vs DDP {ratio(row['vs_torchrun_ddp'])}"
              if ips else f"failed: {row['note']}"), flush=True)
        bar.update(1)
    bar.close()
    return rows


def _fastest(args, model: str, name: str, lay: Layout, gb: int,
             row: dict[str, Any]) -> Optional[dict[str, Any]]:
    """``measure`` of ``lay`` (a pipeline without micro-batches: each of ``PP_MICROBATCH_TRIES`` that
    splits the batch, the fastest kept); None if none ran, ``row["note"]`` then saying why."""
    tries = [lay]
    if lay.pp > 1 and lay.num_microbatches is None:
        tries = [dataclasses.replace(lay, num_microbatches=m) for m in PP_MICROBATCH_TRIES
                 if gb // lay.dp % m == 0]
    best: Optional[dict[str, Any]] = None
    for t in tries:
        try:
            tag = f"{model}-{name}{'' if t is lay else 'm' + str(t.num_microbatches)}-B{gb}"
            r = measure(base_config(args, model, t, gb), args.warmup, args.steps, trace_steps=args.trace,
                        trace_to=args.out / f"trace-{tag}.txt" if args.trace else None,
                        call_timeout_s=args.call_timeout_s)
        except (ClusterError, ValueError) as e:
            row["note"] = first_line(e)[:200]
            continue
        if best is None or r["images_per_s"] > best["images_per_s"]:
            best = r
    return best


def _compare(args, row: dict[str, Any], devices: int, single: dict, anchors: dict) -> None:
    """Add to ``row`` its speedup over rayconv on 1 device and its ratios to the anchors (run once per
    (model, batch, devices), synthetic data only): plain PyTorch on 1 device, torchrun DDP on ``devices``."""
    model, gb = row["model"], row["global_batch_size"]
    for n in {1, devices}:
        if args.anchors and args.data == "synthetic" and (model, gb, n) not in anchors:
            anchors[(model, gb, n)] = run_anchor(model, n, gb, args)
    one = single.get((model, gb))
    ips = row.get("images_per_s")
    row["speedup_vs_1"] = ips / one if ips and one else None
    a1, an = anchors.get((model, gb, 1)), anchors.get((model, gb, devices))
    an = an if devices > 1 else None
    row["plain_pytorch_images_per_s"] = a1["images_per_s"] if a1 else None
    # Which configuration was fastest, and every candidate's images/s (JSON).
    row["plain_pytorch_config"] = a1["config"] if a1 else None
    row["plain_pytorch_candidates"] = json.dumps(a1["candidates"]) if a1 else None
    row["torchrun_ddp_config"] = an["config"] if an else None
    row["torchrun_ddp_candidates"] = json.dumps(an["candidates"]) if an else None
    row["vs_plain_pytorch"] = ips / a1["images_per_s"] if ips and a1 else None
    row["torchrun_ddp_images_per_s"] = an["images_per_s"] if an else None
    row["vs_torchrun_ddp"] = ips / an["images_per_s"] if ips and an else None


def ratio(v: Optional[float]) -> str:
    """A ratio for the RESULT lines: ``1.23x``, or ``not measured``."""
    return f"{v:.2f}x" if v else "not measured"


def sweep_batch(args, until_largest: bool) -> list[dict[str, Any]]:
    """Per-device batch --min-batch (16), doubling up to --max-batch for each layout (RQ4), stopping at the
    first that does not fit. With ``until_largest`` (``--sweep memory``, RQ5) the cap is lifted to 65536
    unless --max-batch was given, so each layout doubles until it runs out of memory: the last row that fits
    is its largest trainable batch (to within a factor of 2). Rows go to ``sweep_batch.parquet`` or
    ``sweep_memory.parquet`` after every batch."""
    if until_largest and args.max_batch == 1024:
        args.max_batch = 65536
    path = args.out / ("sweep_memory.parquet" if until_largest else "sweep_batch.parquet")
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for name in args.layouts.split(","):
            lay = Layout.parse(name)
            per = args.min_batch
            while per <= args.max_batch:
                gb = per * lay.dp  # (the per-layer plan's dp is all its actors)
                row = {"model": model, "layout": name, "batch_per_device": per, "global_batch_size": gb}
                try:
                    # 3 warm-up steps: on GPUs, 2 eager steps and the one CUDA graph capture
                    r = measure(base_config(args, model, lay, gb), 3, max(3, args.steps // 4), 0,
                                call_timeout_s=args.call_timeout_s)
                    rows.append({**row, "fits": True, "images_per_s": r["images_per_s"],
                                 "peak_gib_max": r["peak_gib_max"], "note": None})
                except (ClusterError, ValueError) as e:
                    rows.append({**row, "fits": False, "images_per_s": None, "peak_gib_max": None,
                                 "note": first_line(e)[:200]})
                    break
                finally:  # after every batch: a cut-short sweep keeps what it measured
                    if rows:
                        table = pa.Table.from_pylist(rows)
                        atomic_write(path, lambda tmp: pq.write_table(table, tmp))
                print(f"SWEEP {model} {name} per-device {per}: {r['images_per_s']:.0f} images/s, "
                      f"{r['peak_gib_max']} GiB", flush=True)
                per *= 2
    return rows


def training_curve(args) -> list[dict[str, Any]]:
    """Test error against wall-clock time for each layout on the real digits data (Figure 1); with
    ``--global-batch-size`` given, for each of its batch sizes (RQ4's convergence against batch).
    Writes ``curve.parquet`` and ``curve.png``; each run's own folder is ``curve-<layout>[-B<batch>]``.
    With ``--target-accuracy A`` each run also times the first evaluation reaching A, one bench row a
    run (``bench.parquet``, ``bench.md``: ``target_row``)."""
    out = args.out
    rows, bench_rows = [], []
    for gb, name in [(b, name) for b in args.curve_batches for name in args.layouts.split(",")]:
        label = name if gb is None else f"{name} B={gb}"
        cfg = Config(**{**dict(model="convnet", data="digits", epochs=args.curve_epochs, device=args.device,
                               address=args.address, progress=False, eval_every=5, compile=args.compile,
                               cuda_graphs=args.cuda_graphs, target_accuracy=args.target_accuracy,
                               out=str(out / f"curve-{name}" if gb is None else out / f"curve-{name}-B{gb}")),
                        **({} if gb is None else {"global_batch_size": gb}),
                        **Layout.parse(name).to_config_fields()}).validate()
        remove(place(cfg.out))
        summary = train_run(cfg, log=lambda *_: None)
        if args.target_accuracy is not None:
            bench_rows.append(target_row(name, cfg, summary))
            write_table(bench_rows, out)
        table = read_rows((place(cfg.out) / "metrics.parquet").read_bytes())
        evals = [
            {
                "layout": name,
                "global_batch_size": cfg.global_batch_size,
                "label": label,
                "time_s": r["time_s"],
                "step": r["step"],
                "test_error": r["test_error"],
            }
            for r in table
            if r["kind"] == "eval"
        ]
        rows += evals
        if evals:
            print(
                f"CURVE {label}: test error {evals[-1]['test_error']:.4f} after {evals[-1]['time_s']:.1f} s "
                f"({evals[-1]['step'] + 1} steps)", flush=True)
    atomic_write(out / "curve.parquet", lambda tmp: pq.write_table(pa.Table.from_pylist(rows), tmp))
    error_against_time(rows, "label", "test error vs time, digits (Yadan et al. 2013, Fig. 1)",
                       out / "curve.png")
    return rows


def target_row(name: str, cfg: Config, summary: dict[str, Any]) -> dict[str, Any]:
    """A bench row (``BENCH_SCHEMA``) of one ``fit`` run with a target: its images/s, test accuracy and
    time to ``cfg.target_accuracy`` (``note`` says when it was not reached)."""
    reached = summary["time_to_target_s"] is not None
    return {
        "model": cfg.model,
        "layout": name,
        "global_batch_size": cfg.global_batch_size,
        "image_size": cfg.data_image_size,
        "data": cfg.data,
        "world_size": summary["layout"]["world_size"],
        "images_per_s": summary["images_per_s"],
        "test_accuracy": summary["test_accuracy"],
        **{
            k: summary[k]
            for k in ("target_accuracy", "time_to_target_s", "time_to_target_train_s", "first_steps_s")
        },
        "note": (
            ""
            if reached
            else (
                f"test accuracy {summary['test_accuracy']:.4f} never reached "
                f"{cfg.target_accuracy:g} in {summary['steps']} steps"
            )
        ),
    }


__all__ = ["main_bench", "sweep_batch", "training_curve", "target_row", "ratio", "PP_MICROBATCH_TRIES"]

"""The driver: plan once, start the actors, then a synchronous SGD step loop a newcomer can read.

    plan     = make_plan(cfg, mesh, model)          # layers, stages, schedule: checked before any actor
    gang     = start_workers(cfg, mesh)              # one actor per device, placement group, ranks
    gang.setup(rank, rendezvous, plan)               # process groups, model parts, optimizers
    for step in range(total_steps):
        gang.train_step(step, lr(step))              # one call per actor per step; tensors stay in actors
        every eval_every steps: gang.evaluate()      # exact test error over the held-out set
    model.pt <- assemble(gang.state())              # a plain state_dict of the whole model

Synchronous SGD unchanged (Yadan et al. 2013): every step equals one single-device step on the
global batch, whatever the layout.
"""

from __future__ import annotations

import math
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from . import cluster
from .checkpoint import assemble, export_model
from .config import Config
from .data import Sharding, make_source
from .metrics import MetricsLog, reduce_step, write_json
from .models import build_model
from .parallel.plan import make_plan
from .schedule import format_grid


def learning_rate(cfg: Config, step: int, total_steps: int) -> float:
    """lr of ``step``: constant, or cosine decay from ``cfg.lr`` to 0 over the run (Loshchilov & Hutter 2017)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * step / max(1, total_steps)))


def new_run_dir(cfg: Config) -> Path:
    if cfg.out:
        return Path(cfg.out)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.model}-{cfg.data}"


def prepare(cfg: Config):
    """Connect to Ray, resolve the layout against the cluster, open the data and plan the model.

    Returns (mesh, source, plan). Raises ConfigError / DataError / PlanError / ClusterError before
    any actor starts."""
    cluster.connect(cfg.address)
    mesh = cluster.resolve_layout(cfg)
    source = make_source(cfg)
    torch.manual_seed(cfg.seed)
    reference = build_model(cfg.model, source.num_classes, source.sample_shape[0], source.sample_shape[1])
    return mesh, source, make_plan(cfg, mesh, reference, source.sample_shape)


def launch(cfg: Config, mesh, plan, run_name: str):
    """Start the actors and set them up (process groups, model parts). Returns (gang, setup reports)."""
    gang = cluster.start_workers(cfg, mesh, run_name)
    try:
        master = gang.call("free_address", ranks=[0])[0]
        return gang, gang.call_each("setup", [(r, master, plan) for r in range(mesh.world_size)])
    except BaseException:
        gang.kill()
        raise


def fit(cfg: Config, log=print, on_step=None) -> dict[str, Any]:
    """Train as ``cfg`` says; write config.json, metrics.parquet, summary.json and model.pt into the
    output folder; return the summary. ``on_step(gang, step)``, if given, is called after each step
    (tests use it to inspect every actor). Raises ConfigError / DataError / PlanError before anything is
    written, ClusterError if an actor fails (the output folder is then removed if this run made it).
    """
    t_start = time.perf_counter()
    mesh, source, plan = prepare(cfg)
    sharding = Sharding(source.train_size, cfg.global_batch_size, mesh.dp, cfg.seed)
    total_steps = cfg.steps or (cfg.epochs or 10) * sharding.steps_per_epoch
    eval_every = cfg.eval_every or sharding.steps_per_epoch

    out = new_run_dir(cfg)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} already holds files: choose a new folder (nothing was overwritten)")
    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    cfg.out = str(out)
    run_name = out.name
    gang = None
    try:
        cfg.to_json(out / "config.json")
        log(f"rayconv: {cfg.model} on {cfg.data} ({source.train_size} train / {source.test_size} test images, "
            f"{source.num_classes} classes), layout {mesh.describe()} on {cfg.device}, "
            f"global batch {cfg.global_batch_size}, {total_steps} steps -> {out}")
        if mesh.pp > 1:
            log(f"pipeline stages {list(plan.stages)}, schedule {cfg.schedule}, "
                f"{cfg.num_microbatches} micro-batches:\n{format_grid(plan.schedule)}")
        gang, setups = launch(cfg, mesh, plan, run_name)
        metrics = MetricsLog()
        t_train = time.perf_counter()
        bar = tqdm(total=total_steps, desc="train", unit="step", disable=not cfg.progress, dynamic_ncols=True,
                   mininterval=1.0)
        last_eval: dict[str, float] = {}
        lrs: dict[int, float] = {}
        t_last = [time.perf_counter()]

        def record(results: list) -> None:
            """Log the step whose metrics came back (one step behind the launches)."""
            results = [x for x in results if x is not None]
            if not results:
                return
            now = time.perf_counter()
            step_s, t_last[0] = now - t_last[0], now
            r, k = reduce_step(results), results[0]["step"]
            ips = results[0]["global_count"] / step_s
            metrics.add(kind="train", step=k, epoch=results[0]["epoch"], loss=r["loss"], lr=lrs.pop(k),
                        images_per_s=ips, step_ms=step_s * 1e3, time_s=now - t_train)
            if not math.isfinite(r["loss"]):
                raise FloatingPointError(f"loss is {r['loss']} at step {k}: lower --lr (now {cfg.lr})")
            bar.update(1)
            bar.set_postfix(loss=f"{r['loss']:.4f}", img_s=f"{ips:.0f}",
                            **({"test_acc": f"{last_eval['test_accuracy']:.4f}"} if last_eval else {}))
            if not cfg.progress and (k % cfg.log_every == 0 or k + 1 == total_steps):
                log(f"step {k:5d} epoch {results[0]['epoch']:3d} loss {r['loss']:.4f} lr {metrics.rows[-1]['lr']:.4g} "
                    f"{ips:8.0f} images/s" + (f" test_acc {last_eval['test_accuracy']:.4f}" if last_eval else ""))

        for step in range(total_steps):
            lrs[step] = learning_rate(cfg, step, total_steps)
            record(gang.call("train_step", step, lrs[step]))
            if (step + 1) % eval_every == 0 or step + 1 == total_steps or on_step is not None:
                record(gang.call("flush"))
            if (step + 1) % eval_every == 0 or step + 1 == total_steps:
                last_eval = evaluate(gang)
                metrics.add(kind="eval", step=step, epoch=step // sharding.steps_per_epoch,
                            time_s=time.perf_counter() - t_train, **last_eval)
                t_last[0] = time.perf_counter()  # evaluation time is not a training step's
            if on_step is not None:
                on_step(gang, step)
        bar.close()
        train_s = time.perf_counter() - t_train

        # Export: replica 0's actors hold the whole model between them.
        # (Under the per-layer plan every actor holds a slice of the FC layers.)
        holders = list(range(mesh.world_size)) if cfg.plan != "none" else \
            [mesh.rank((0, p, f)) for p in range(mesh.pp) for f in range(mesh.fs)]
        states = gang.call("state", ranks=holders)
        split_dims: dict[str, int] = {}
        for d in gang.call("split_dims", ranks=holders):
            split_dims.update(d)
        torch.manual_seed(cfg.seed)
        fresh = build_model(cfg.model, source.num_classes, source.sample_shape[0], source.sample_shape[1])
        export_model(out / "model.pt", assemble(states, split_dims), fresh)
        memory = gang.call("memory")
        metrics.write(out / "metrics.parquet")
        train_rows = [row for row in metrics.rows if row["kind"] == "train"]
        steady = train_rows[min(len(train_rows) - 1, 2):]  # skip warm-up steps
        summary = {
            "model": cfg.model, "data": cfg.data, "device": cfg.device,
            "layout": {"dp": mesh.dp, "pp": mesh.pp, "fs": mesh.fs, "world_size": mesh.world_size,
                       "plan": cfg.plan, "schedule": cfg.schedule if mesh.pp > 1 else None,
                       "num_microbatches": cfg.num_microbatches, "stages": [list(s) for s in plan.stages]},
            "global_batch_size": cfg.global_batch_size, "steps": total_steps,
            "epochs": total_steps / sharding.steps_per_epoch,
            "final_train_loss": train_rows[-1]["loss"],
            "test_accuracy": last_eval.get("test_accuracy"), "test_error": last_eval.get("test_error"),
            "test_loss": last_eval.get("test_loss"),
            "images_per_s": sum(x["images_per_s"] for x in steady) / len(steady),
            "train_time_s": train_s, "wall_time_s": time.perf_counter() - t_start,
            "actors": [{**s, **m} for s, m in zip(setups, memory)],
        }
        write_json(out / "summary.json", summary)
        log(f"done: train loss {summary['final_train_loss']:.4f}, test accuracy {summary['test_accuracy']:.4f}, "
            f"{summary['images_per_s']:.0f} images/s, {summary['wall_time_s']:.1f} s -> {out}")
        return summary
    except BaseException:
        # Nothing half-written stays behind: the folder was empty (or new) when this run began.
        if made_out:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for p in out.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        raise
    finally:
        if gang is not None:
            gang.kill()


def evaluate(gang: "cluster.Gang") -> dict[str, float]:
    """Test loss, error and accuracy over every held-out sample once (summed over replicas)."""
    res = [r for r in gang.call("evaluate") if r["reports"]]
    n = sum(r["samples"] for r in res)
    correct = sum(r["correct"] for r in res)
    return {"test_loss": sum(r["loss_sum"] for r in res) / max(1, n),
            "test_accuracy": correct / max(1, n), "test_error": 1.0 - correct / max(1, n)}

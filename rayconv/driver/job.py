"""The driver: plan once, start the actors, then a synchronous SGD step loop a newcomer can read.

    plan     = make_plan(cfg, mesh, model)          # layers, stages, schedule: checked before any actor
    gang     = start_workers(cfg, mesh)              # one actor per device, placement group, ranks
    gang.setup(rank, rendezvous, plan)               # process groups, model parts, optimizers
    for step in range(total_steps):
        gang.train_step(step, lr(step))              # one call per actor per step; tensors stay in actors
        every eval_every steps: gang.evaluate()      # exact test error over the held-out set
        every checkpoint_every steps: checkpoints/step-<k>/ <- gang.checkpoint_shard()
    model.pt <- assemble(gang.state())              # a plain state_dict of the whole model

An actor lost mid-run (process or node died, collective timed out) ends the step for all; with
--max-failures F the driver then starts new actors, reloads the last checkpoint and continues (F times).

Synchronous SGD unchanged (Yadan et al. 2013): every step equals one single-device step on the
global batch, whatever the layout.
"""

from __future__ import annotations

import math
import secrets
import shutil
import sys
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from rayconv.cluster import group as cluster
from rayconv.outputs.checkpoint import Checkpoint, check_resumable, latest_checkpoint, list_checkpoints, load_checkpoint, remove_partial, shard_for, write_checkpoint
from rayconv.errors import CallTimeout, CheckpointError, ClusterError
from rayconv.config import Config, batch_split_problem
from rayconv.data.registry import make_source
from rayconv.data.source import Sharding
from rayconv.outputs.export import assemble, export_model
from rayconv.planner.search import choose_layout, compare, memory_check
from rayconv.outputs.metrics import MetricsLog, actor_gauges, read_rows, reduce_step
from rayconv.files import write_json
from rayconv.mesh import Mesh
from rayconv.models import build_model, check_trainable, model_names, run_model
from rayconv.parallel.layout_plan import make_plan, measured_costs
from rayconv.parallel.pipeline.validate import bubble_fraction, format_grid


RATE_WINDOW = 20  # steps: the progress line's images/s is over the wall-clock of the last 20


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


def new_run_name(out: Path) -> str:
    """The run's name on the cluster (placement group ``rayconv/<name>``, actors ``rayconv/<name>/<role>``,
    the gauges' ``run`` tag): the output folder's name and a random suffix, e.g. ``r1-3f9a2c``, so that
    runs whose folders share a name (``/tmp/a/run``, ``/tmp/b/run``) can share a cluster."""
    return f"{out.name}-{secrets.token_hex(3)}"


def prepare(cfg: Config, log=print, resume: Optional[Checkpoint] = None):
    """Check everything that needs no cluster, then connect to Ray, resolve the layout against the
    cluster and plan the model.

    Before Ray starts: the data (folders), the model (name, image shape, training output), the layout
    against the model (with --dp as given, 1 when the cluster decides it) and ``resume``'s checkpoint
    against the run. Returns (mesh, source, plan). Raises ConfigError / DataError / PlanError /
    CheckpointError / ClusterError before any actor starts."""
    if cfg.model not in model_names():
        build_model(cfg.model, 1)  # raises ConfigError naming --model, before the data is read
    dp_given = cfg.dp is not None
    if dp_given:
        memory_check(cfg)  # --max-memory-gib: refused before Ray starts
    source = make_source(cfg)
    reference = run_model(cfg, source)
    check_trainable(cfg.model, reference, tuple(source.sample_shape))
    plan = make_plan(cfg, Mesh(cfg.dp or 1, cfg.pp, cfg.fs), reference, source.sample_shape)
    if resume is not None:  # (a resumed run's --dp comes from its checkpoint)
        check_resumable(resume, cfg, plan.mesh, plan.stages, source.num_classes, tuple(source.sample_shape))
    # (with --dp left to the cluster, at least one replica: --fs 3 alone on 2 cores still runs)
    wanted = (cfg.dp or 1) * cfg.pp * cfg.fs * cfg.num_cpus_per_actor
    cluster.connect(cfg.address, min_cpus=wanted if cfg.device != "cuda" else None)
    mesh = cluster.resolve_layout(cfg, log)
    if not dp_given:
        memory_check(cfg)  # (with --dp from the cluster: before any actor starts)
    if mesh != plan.mesh:
        plan = make_plan(cfg, mesh, reference, source.sample_shape)
    by_time = cfg.balance == "time" or (cfg.balance == "auto" and cfg.device == "cuda")
    if mesh.pp > 1 and not cfg.stages and by_time:
        # Balance the stages by measured layer times (on one device of the cluster, at the micro-batch
        # size); the cut is written into the settings so that a resumed run keeps it.
        micro_batch = max(1, cfg.global_batch_size // mesh.dp // cfg.num_microbatches)
        costs = cluster.run_on_device(measured_costs, (cfg.to_dict(), micro_batch), gpu=cfg.device == "cuda")
        plan = make_plan(cfg, mesh, reference, source.sample_shape, costs=costs)
        cfg.stages = ",".join(str(a) for a, _ in plan.stages[1:])
        log(f"pipeline stages balanced by measured forward+backward time per layer (ms, micro-batch "
            f"{micro_batch}): " + ", ".join(f"{sum(costs[a:b]):.2f}" for a, b in plan.stages))
    return mesh, source, plan


def output_folder(cfg: Config, resume: Optional[Checkpoint]) -> Path:
    """The run's output folder: ``--out``, else the resumed run's folder, else a new one under runs/.
    Raises CheckpointError / FileExistsError when writing there would lose something (nothing is made)."""
    out = new_run_dir(cfg) if (cfg.out or resume is None) else resume.run_dir
    if resume is not None and out.resolve() == resume.run_dir.resolve():
        newer = [p.name for p in list_checkpoints(out) if int(p.name.split("-")[1]) > resume.step]
        if newer:
            raise CheckpointError(f"--resume {resume.path} is older than {', '.join(newer)} of the same run: "
                                  f"resume from the newest, or give --out NEW to branch off from step {resume.step}")
    elif out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: choose a folder (nothing was overwritten)")
    elif out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} already holds files: choose a new folder (nothing was overwritten)")
    return out


def call_timeout_s(cfg: Config) -> float:
    """Seconds one call to the actors may take before they are stopped: a collective fails after
    ``--collective-timeout-s`` inside the actors; this catches an actor stuck outside any collective."""
    return 2 * cfg.collective_timeout_s + 30


def launch(cfg: Config, mesh, plan, run_name: str):
    """Start the actors and set them up (process groups, model parts). Returns (gang, setup reports)."""
    gang = cluster.start_workers(cfg, mesh, run_name)
    try:
        limit = call_timeout_s(cfg)
        master = gang.call("free_address", ranks=[0], timeout_s=limit)[0]
        return gang, gang.call_each("setup", [(r, master, plan) for r in range(mesh.world_size)], timeout_s=limit)
    except BaseException:
        gang.kill()
        raise


def overlap_note(cfg: Config, mesh, plan) -> Optional[str]:
    """The note a pipeline with fewer micro-batches than stages gets: its bubble, and a
    ``--num-microbatches`` that divides the batch and lets the stages overlap (None when there are
    enough micro-batches, or none that divides the batch)."""
    if mesh.pp == 1 or cfg.num_microbatches >= mesh.pp:
        return None
    better = [m for m in (4 * mesh.pp, 2 * mesh.pp, mesh.pp)
              if batch_split_problem(cfg.global_batch_size, mesh.dp, m) is None]
    if not better:
        return None
    micro = f"{cfg.num_microbatches} micro-batch{'es' if cfg.num_microbatches > 1 else ''}"
    return (f"note: with {micro} for {mesh.pp} stages the stages mostly take turns (bubble "
            f"{bubble_fraction(plan.schedule):.0%} of the step); --num-microbatches {better[0]} lets them overlap")


def fit(cfg: Config, log=print, on_step=None) -> dict[str, Any]:
    """Train as ``cfg`` says; write config.json, metrics.parquet, summary.json and model.pt into the
    output folder (and checkpoints/ every ``cfg.checkpoint_every`` steps); return the summary.
    ``on_step(gang, step)``, if given, is called after each step (tests use it to inspect every actor).
    Raises ConfigError / DataError / PlanError / CheckpointError before anything is written,
    ClusterError if an actor fails more than ``cfg.max_failures`` times. On failure the output folder
    is removed if this run made it and it holds no checkpoint; checkpoints are never deleted.
    """
    t_start = time.perf_counter()
    resume = load_checkpoint(cfg.resume) if cfg.resume else None
    out = output_folder(cfg, resume)
    predicted = choose_layout(cfg, log) if cfg.layout == "auto" else None  # sets the layout settings
    mesh, source, plan = prepare(cfg, log, resume)
    sharding = Sharding(source.train_size, cfg.global_batch_size, mesh.dp, cfg.seed)
    total_steps = cfg.steps or (cfg.epochs or 10) * sharding.steps_per_epoch
    eval_every = cfg.eval_every or sharding.steps_per_epoch
    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    cfg.out = str(out)
    run_name = new_run_name(out)
    gang = None
    try:
        cfg.to_json(out / "config.json")
        log(f"rayconv: {cfg.model} on {cfg.data} ({source.train_size} train / {source.test_size} test images, "
            f"{source.num_classes} classes), layout {mesh.describe()}"
            f"{' plan ' + cfg.plan if cfg.plan != 'none' else ''} on {cfg.device}, "
            f"global batch {cfg.global_batch_size}, {total_steps} steps -> {out}; Ray run name {run_name}")
        if resume is not None:
            log(f"rayconv: resuming from {resume.path} (step {resume.step} of {total_steps})")
        if mesh.pp > 1:
            chunks = (f", interleaved: {cfg.virtual_stages} model chunks per stage (stage s holds chunks s, s + "
                      f"{mesh.pp}, ...)" if cfg.virtual_stages > 1 else "")
            micro = f"{cfg.num_microbatches} micro-batch{'es' if cfg.num_microbatches > 1 else ''}"
            log(f"pipeline stages {list(plan.stages)}, schedule {cfg.schedule}{chunks}, {micro}:\n"
                f"{format_grid(plan.schedule)}")
            note = overlap_note(cfg, mesh, plan)
            if note:
                log(note)
        run = _Run(cfg, mesh, plan, source, sharding, total_steps, eval_every, out, run_name, log, on_step)
        ckpt, failures = resume, 0
        while True:
            try:
                gang = run.start(ckpt)
                run.train(gang, start=ckpt.step if ckpt is not None else 0)
                break
            except ClusterError as e:
                if isinstance(e, CallTimeout):
                    e = CallTimeout(f"{e}; the limit is 2 x --collective-timeout-s + 30 s: raise "
                                            "--collective-timeout-s if the work is only slow", recoverable=True)
                if gang is not None:
                    gang.kill()
                    gang = None
                if not e.recoverable or failures >= cfg.max_failures:
                    raise e from None
                failures += 1
                latest = latest_checkpoint(out)
                ckpt = load_checkpoint(latest) if latest is not None else resume
                log(f"rayconv: {e}\nrayconv: recovering ({failures} of --max-failures {cfg.max_failures}): "
                    f"new actors, continuing from {ckpt.path if ckpt else 'the start'}")
        train_s = run.train_s

        # Export: replica 0's actors hold the whole model between them.
        # (Under the per-layer plan every actor holds a slice of the FC layers.)
        holders = list(range(mesh.world_size)) if cfg.plan != "none" else \
            [mesh.rank((0, p, f)) for p in range(mesh.pp) for f in range(mesh.fs)]
        states = gang.call("state", ranks=holders, timeout_s=run.call_timeout_s)
        split_dims: dict[str, int] = {}
        for d in gang.call("split_dims", ranks=holders, timeout_s=run.call_timeout_s):
            split_dims.update(d)
        fresh = run_model(cfg, source)
        export_model(out / "model.pt", assemble(states, split_dims), fresh)
        memory = gang.call("memory", timeout_s=run.call_timeout_s)
        metrics = run.metrics
        metrics.write(out / "metrics.parquet")
        train_rows = [row for row in metrics.rows if row["kind"] == "train"]
        stall_ms = sum(x.get("input_stall_ms") or 0.0 for x in train_rows)
        own_ms = sum(x["step_ms"] or 0.0 for x in train_rows)
        last_eval = run.last_eval
        summary = {
            "model": cfg.model, "data": cfg.data, "device": cfg.device,
            "layout": {"dp": mesh.dp, "pp": mesh.pp, "fs": mesh.fs, "world_size": mesh.world_size,
                       "plan": cfg.plan, "schedule": cfg.schedule if mesh.pp > 1 else None,
                       "num_microbatches": cfg.num_microbatches, "virtual_stages": cfg.virtual_stages,
                       "exchange_chunks": cfg.exchange_chunks if mesh.fs > 1 else None,
                       "stages": [list(s) for s in plan.stages]},
            "global_batch_size": cfg.global_batch_size, "steps": total_steps,
            "epochs": total_steps / sharding.steps_per_epoch,
            "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
            "test_accuracy": last_eval.get("test_accuracy"), "test_error": last_eval.get("test_error"),
            "test_loss": last_eval.get("test_loss"), "test_top5_accuracy": last_eval.get("test_top5_accuracy"),
            "images_per_s": run.images_per_s(),
            # The steps' waits for input not overlapped with compute, summed, and their share of the steps' time.
            "input_stall_s": stall_ms / 1e3, "input_stall_fraction": stall_ms / own_ms if own_ms > 0 else None,
            "train_time_s": train_s, "wall_time_s": time.perf_counter() - t_start,
            "run_name": run_name,
            "resumed_from": str(resume.path) if resume is not None else None, "failures_recovered": failures,
            "actors": [{**s, **m} for s, m in zip(run.setups, memory)],
        }
        if predicted is not None:
            summary["planner"] = compare(predicted, summary)
        write_json(out / "summary.json", summary)
        log(f"done: train loss {summary['final_train_loss']:.4f}, test accuracy {summary['test_accuracy']:.4f}, "
            f"{summary['images_per_s']:.0f} images/s, {summary['wall_time_s']:.1f} s -> {out}")
        return summary
    except BaseException:
        # Nothing half-written stays behind, but checkpoints are never deleted: a folder holding one
        # keeps it (and config.json) so that the run can be resumed.
        remove_partial(out)
        if list_checkpoints(out):
            pass
        elif made_out:
            shutil.rmtree(out, ignore_errors=True)
            log(f"rayconv: {out} removed: the run stopped before any result or checkpoint was written")
        else:  # the folder was empty when this run began
            for p in out.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            log(f"rayconv: {out} left empty: the run stopped before any result or checkpoint was written")
        raise
    finally:
        if gang is not None:
            gang.kill()


class _Run:
    """The state of one run across attempts (a recovery starts new actors and continues)."""

    def __init__(self, cfg, mesh, plan, source, sharding, total_steps, eval_every, out, run_name, log, on_step):
        self.cfg, self.mesh, self.plan, self.source, self.sharding = cfg, mesh, plan, source, sharding
        self.total_steps, self.eval_every, self.out, self.run_name = total_steps, eval_every, out, run_name
        self.log, self.on_step = log, on_step
        self.metrics = MetricsLog()
        self.last_eval: dict[str, float] = {}
        self.setups: list[dict[str, Any]] = []
        self.train_s = 0.0
        self.call_timeout_s = call_timeout_s(cfg)
        # step -> (images, driver wall-clock seconds from the previous result to this one, evaluation and
        # checkpoint time left out), over every attempt of this process: the summary's images/s.
        self.wall: dict[int, tuple[int, float]] = {}

    def images_per_s(self) -> Optional[float]:
        """Training images per second of wall-clock: images of the steps this process ran, after the
        first two (compiling, warming up) when at least four ran, over the driver's wall-clock time of
        those steps (evaluation and checkpoint time left out). With two steps in flight one step's
        result can come back just after the one before it, so no single step's wall time is its own;
        summed over steps they are the training time."""
        steps = sorted(self.wall)
        steady = [self.wall[k] for k in (steps[2:] if len(steps) >= 4 else steps)]
        seconds = sum(s for _, s in steady)
        return sum(n for n, _ in steady) / seconds if seconds > 0 else None

    def start(self, ckpt: Optional[Checkpoint]) -> "cluster.Gang":
        """Start the actors, set them up, and load ``ckpt`` (and its metrics rows) if given."""
        cfg, mesh = self.cfg, self.mesh
        gang = cluster.start_workers(cfg, mesh, self.run_name, timeout_s=cfg.max_wait)
        try:
            master = gang.call("free_address", ranks=[0], timeout_s=self.call_timeout_s)[0]
            self.setups = gang.call_each("setup", [(r, master, self.plan) for r in range(mesh.world_size)],
                                         timeout_s=self.call_timeout_s)
            self.metrics = MetricsLog()
            self.last_eval = {}
            if ckpt is not None:
                gang.call_each("load_shard", [(shard_for(ckpt, mesh, r), ckpt.step) for r in range(mesh.world_size)],
                               timeout_s=self.call_timeout_s)
                if "metrics.parquet" in ckpt.files:
                    self.metrics.rows = [r for r in read_rows(ckpt.files["metrics.parquet"]) if r["step"] < ckpt.step]
                    evals = [r for r in self.metrics.rows if r["kind"] == "eval"]
                    if evals:
                        self.last_eval = {k: evals[-1].get(k) for k in ("test_loss", "test_accuracy", "test_error",
                                                                        "test_top5_accuracy")}
        except BaseException:
            gang.kill()
            raise
        return gang

    def train(self, gang: "cluster.Gang", start: int) -> None:
        """Steps ``start`` .. total_steps - 1, with evaluations and checkpoints.

        Two steps are in flight: step k+1 is queued on the actors before step k's call returns, and
        each call returns the metrics of the step before it, so neither the device nor the actor
        waits for the driver between steps (the bench's ``driver_overhead`` measures what is left)."""
        cfg, total_steps = self.cfg, self.total_steps
        metrics = self.metrics
        t_train = time.perf_counter()
        t_last = [t_train]
        lrs: dict[int, float] = {}
        # The progress rate: images over the wall-clock of the last RATE_WINDOW results (the attempt's first,
        # which compiles, left out once 4 more came back). With two steps in flight a result's wall time
        # can hold its neighbour's step (or none, just after an evaluation); over several it evens out.
        window: deque = deque(maxlen=RATE_WINDOW)
        # A progress bar on a terminal; plain progress lines every --log-every steps otherwise (a log file).
        use_bar = cfg.progress and sys.stderr.isatty()
        bar = tqdm(total=total_steps, initial=start, desc="train", unit="step", disable=not use_bar,
                   dynamic_ncols=True, mininterval=1.0)

        def record(results: list) -> None:
            """Log the step whose metrics came back."""
            results = [x for x in results if x is not None]
            if not results:
                return
            now = time.perf_counter()
            wall_s, t_last[0] = now - t_last[0], now
            r, k, epoch = reduce_step(results), results[0]["step"], results[0]["epoch"]
            count = results[0]["global_count"]
            self.wall[k] = (count, wall_s)
            window.append((count, wall_s, k == start))
            recent = list(window)[1:] if window[0][2] and len(window) > 4 else window
            ips = sum(n for n, _, _ in recent) / max(1e-9, sum(w for _, w, _ in recent))
            # The row: the step's own time, measured in the actors (the driver's wall time between two
            # results can belong partly to the neighbouring step with two in flight).
            step_ms = r["step_ms"] if r["step_ms"] is not None else wall_s * 1e3
            stall = r["input_stall_ms"]
            metrics.add(kind="train", step=k, epoch=epoch, loss=r["loss"], lr=lrs.pop(k),
                        images_per_s=count / max(1e-9, step_ms / 1e3), step_ms=step_ms,
                        input_stall_ms=stall,
                        input_stall_fraction=None if stall is None else stall / max(1e-9, step_ms),
                        time_s=self.train_s + now - t_train)
            if cfg.metrics:
                actor_gauges(self.run_name, "driver", images_per_s=ips, step_ms=step_ms, loss=r["loss"], step=k)
            if not math.isfinite(r["loss"]):
                raise FloatingPointError(f"loss is {r['loss']} at step {k}: lower --lr (now {cfg.lr})")
            bar.update(1)
            bar.set_postfix(loss=f"{r['loss']:.4f}", img_s=f"{ips:.0f}",
                            **({"test_acc": f"{self.last_eval['test_accuracy']:.4f}"} if self.last_eval else {}))
            if not use_bar and (k % cfg.log_every == 0 or k + 1 == total_steps):
                self.log(f"step {k:5d} epoch {epoch:3d} loss {r['loss']:.4f} lr {metrics.rows[-1]['lr']:.4g} "
                         f"{ips:8.0f} images/s"
                         + (f" test_acc {self.last_eval['test_accuracy']:.4f}" if self.last_eval else ""))

        def boundary(step: int) -> bool:
            """After this step the driver needs the actors quiet (evaluation, checkpoint, test hook)."""
            return ((step + 1) % self.eval_every == 0 or step + 1 == total_steps or self.on_step is not None
                    or bool(cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0))

        try:
            in_flight = None
            for step in range(start, total_steps):
                if in_flight is None:
                    lrs[step] = learning_rate(cfg, step, total_steps)
                    in_flight = gang.submit("train_step", step, lrs[step])
                current, in_flight = in_flight, None
                if not boundary(step):  # queue the next step before waiting for this one
                    lrs[step + 1] = learning_rate(cfg, step + 1, total_steps)
                    in_flight = gang.submit("train_step", step + 1, lrs[step + 1])
                record(gang.collect(current, timeout_s=self.call_timeout_s))
                if not boundary(step):
                    continue
                record(gang.call("flush", timeout_s=self.call_timeout_s))
                if (step + 1) % self.eval_every == 0 or step + 1 == total_steps:
                    self.last_eval = evaluate(gang, self.call_timeout_s)
                    metrics.add(kind="eval", step=step, epoch=step // self.sharding.steps_per_epoch,
                                time_s=self.train_s + time.perf_counter() - t_train, **self.last_eval)
                    bar.set_postfix(loss=f"{metrics.last('train', 'loss'):.4f}",
                                    test_acc=f"{self.last_eval['test_accuracy']:.4f}")
                    if not use_bar:
                        top5 = self.last_eval.get("test_top5_accuracy")
                        self.log(f"step {step:5d} test_loss {self.last_eval['test_loss']:.4f} "
                                 f"test_accuracy {self.last_eval['test_accuracy']:.4f}"
                                 + (f" test_top5_accuracy {top5:.4f}" if top5 is not None else ""))
                if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == total_steps):
                    self.checkpoint(gang, step + 1)
                if (step + 1) % self.eval_every == 0 or cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    metrics.write(self.out / "metrics.parquet")  # the progress so far, readable mid-run
                if self.on_step is not None:
                    self.on_step(gang, step)
                t_last[0] = time.perf_counter()  # evaluation and checkpoint time is not a step's
        finally:
            bar.close()
            self.train_s += time.perf_counter() - t_train

    def checkpoint(self, gang: "cluster.Gang", step: int) -> Path:
        """Write checkpoints/step-<step>/ (``step`` steps done) atomically; prune to --keep-checkpoints."""
        cfg, mesh = self.cfg, self.mesh
        shards = gang.call("checkpoint_shard", timeout_s=self.call_timeout_s)
        epoch, step_in_epoch = divmod(step, self.sharding.steps_per_epoch)
        manifest = {
            "model": cfg.model, "num_classes": self.source.num_classes,
            "sample_shape": list(self.source.sample_shape), "precision": cfg.precision,
            "layout": {"dp": mesh.dp, "pp": mesh.pp, "fs": mesh.fs, "plan": cfg.plan,
                       "world_size": mesh.world_size, "stages": [list(s) for s in self.plan.stages],
                       "roles": [mesh.role(r) for r in range(mesh.world_size)]},
            "data": {"data": cfg.data, "next_step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                     "steps_per_epoch": self.sharding.steps_per_epoch, "seed": cfg.seed,
                     "global_batch_size": cfg.global_batch_size},
            "lr_schedule": {"schedule": cfg.lr_schedule, "lr": cfg.lr, "total_steps": self.total_steps,
                            "next_step": step,
                            "next_lr": learning_rate(cfg, step, self.total_steps) if step < self.total_steps else None},
            "config": cfg.to_dict(),
            "written": datetime.now().isoformat(timespec="seconds"),
        }
        path = write_checkpoint(self.out, step, shards, manifest,
                                extra={"metrics.parquet": self.metrics.to_bytes()}, keep=cfg.keep_checkpoints)
        if not cfg.progress:
            self.log(f"checkpoint {path}")
        return path


def evaluate(gang: "cluster.Gang", timeout_s: Optional[float] = None) -> dict[str, Optional[float]]:
    """Test loss, error, top-1 and top-5 accuracy over every held-out sample once (summed over
    replicas); top-5 is None below 5 classes."""
    res = [r for r in gang.call("evaluate", timeout_s=timeout_s) if r["reports"]]
    n = sum(r["samples"] for r in res)
    correct = sum(r["correct"] for r in res)
    top5 = None if any(r.get("correct5") is None for r in res) else sum(r["correct5"] for r in res) / max(1, n)
    return {"test_loss": sum(r["loss_sum"] for r in res) / max(1, n),
            "test_accuracy": correct / max(1, n), "test_error": 1.0 - correct / max(1, n), "test_top5_accuracy": top5}

"""The step loop: one ``train_step`` call per actor per step, two steps in flight; evaluations and
checkpoints between steps.

Step k+1 is queued on the actors before step k's call returns, and each call returns the metrics of the
step before it, so neither the device nor the actor waits for the driver between steps (the bench's
``driver_overhead`` measures what is left). Before an evaluation, the test hook, a preemption's or the
scaling policy's decision and the last step the loop lets the actors go quiet (``flush``); a checkpoint
that needs none of these is queued behind its step (``Run.drains``, ``driver.saving``). Synchronous SGD
unchanged (Yadan et al. 2013): every step equals one single-device step on the global batch, whatever the
layout. Each step's learning rate comes from ``driver.lr``; with ``--model-ema`` each evaluation is
followed by one of the moving average (``evaluate(ema=True)`` on the actors); with
``--precise-bn-batches`` each evaluation is preceded by the batch-norm statistics' recomputation
(``recalibrate_bn`` on the actors); with ``--target-accuracy`` the first evaluation that reaches it is
timed (``driver.target``). With ``--val-split`` each evaluation is of the validation images (``val_*``),
the test split's only at the last step (or every time with ``--eval-test``); the target and
``--keep-best`` (``driver.best``) read the validation accuracy. TensorBoard's event files
(``outputs.tensorboard``) follow each write of metrics.parquet.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rayconv import startup
from rayconv.actor.actor import Actor
from rayconv.cluster.group import ActorGroup, Pending
from rayconv.config import Config
from rayconv.driver import saving
from rayconv.driver.best import Best, load_best, write_best
from rayconv.driver.elastic import DrainWatch, LayoutChanges, cluster_free
from rayconv.driver.policies import CONTINUE, Decision, FixedScaling, ScalingPolicy
from rayconv.driver.progress import Progress
from rayconv.driver.lr import learning_rate
from rayconv.driver.resolve import ResolvedRun, call_timeout_s
from rayconv.driver.target import Target, train_seconds
from rayconv.layout import Layout
from rayconv.outputs.checkpoint import Checkpoint
from rayconv.outputs.export import assemble, export_model
from rayconv.outputs.metrics import MetricsLog, actor_gauges, read_rows, reduce_step
from rayconv.outputs.tensorboard import EventFiles, first_images, import_writers


EVAL_KEYS = ("test_loss", "test_accuracy", "test_error", "test_top5_accuracy", "ema_test_accuracy",
             "val_loss", "val_accuracy", "val_top5_accuracy")


class Run:
    """One run across its attempts (a recovery starts new actors and continues): the setup, and what the
    attempts gathered (metrics rows, the last evaluation, the actors' build reports, training time)."""

    def __init__(self, resolved: ResolvedRun, log=print, on_step=None, on_eval=None,
                 scaling: Optional[ScalingPolicy] = None):
        self.resolved, self.log, self.on_step = resolved, log, on_step
        self.on_eval = on_eval  # on_eval(row, total_steps) after each evaluation (job.train_run)
        self.call_timeout_s = call_timeout_s(resolved.cfg)
        self.metrics = MetricsLog()
        self.last_eval: dict[str, Optional[float]] = {}
        self.actor_reports: list[dict[str, Any]] = []  # what each actor's ``build`` reported
        self.train_s = 0.0
        self.target = Target(resolved.cfg.target_accuracy)  # the first evaluation reaching --target-accuracy
        self.failures = 0     # actor failures recovered from
        self.stop_recorded = False  # a stop's metrics and summary written (``finish.recording_stop``)
        # step -> (images, driver wall-clock seconds from the previous result to this one, evaluation and
        # checkpoint time left out), over every attempt of this process: the summary's images/s.
        self.wall: dict[int, tuple[int, float]] = {}
        self.best = load_best(resolved.out) if resolved.cfg.keep_best else Best()   # --keep-best's
        self.events = EventFiles(resolved.out, resolved.resume.step if resolved.resume is not None else 0,
                                 enabled=resolved.cfg.tensorboard == "on", log=log)
        self.metrics.on_write = self.events.add_rows
        import_writers(self.events.enabled)   # (pyarrow's and TensorBoard's, while the actors set up)
        self.images_logged = not resolved.cfg.log_images   # (--log-images: once, before the first step)
        self.startup = startup.current() or startup.begin(None, "fit call")  # (rayconv.startup)
        # Asked at each step boundary whether to go on (--elastic: ``policies.ElasticScaling``).
        self.scaling: ScalingPolicy = scaling or FixedScaling(resolved.mesh)
        # A preemption notice (an actor's SIGTERM mark: its role; a draining node): the next step is a
        # boundary, where the scaling policy decides.
        self.preempted: Optional[str] = None
        self.changes = LayoutChanges()   # summary.json's ``layout_changes``, and the change under way
        self.checkpoints: saving.Checkpoints = saving.Checkpoints()   # ``driver.saving``

    @property
    def layout_changes(self) -> list[dict[str, Any]]:
        return self.changes.rows

    def use(self, resolved: ResolvedRun) -> None:
        """Continue on another layout (--elastic): ``resolved`` with its mesh, routing and sharding."""
        self.resolved = resolved

    @property
    def cfg(self) -> Config:
        """The run's settings on its current layout (``ResolvedRun.cfg``: dp the mesh's)."""
        return self.resolved.cfg

    @property
    def layout_name(self) -> str:
        """The name of the layout the steps run on now (metrics.parquet's ``layout``)."""
        return Layout.from_config(self.cfg).name

    def continue_from(self, ckpt: Optional[Checkpoint]) -> None:
        """Start an attempt's records: empty, or the metrics rows and last evaluation of ``ckpt``."""
        self.metrics.wait()   # (the last attempt's background write done before the next one writes)
        self.metrics = MetricsLog()
        self.metrics.on_write = self.events.add_rows
        self.last_eval = {}
        if ckpt is None or "metrics.parquet" not in ckpt.files:
            return
        self.metrics.rows = [r for r in read_rows(ckpt.files["metrics.parquet"]) if r["step"] < ckpt.step]
        evals = [r for r in self.metrics.rows if r["kind"] == "eval"]
        if evals:
            self.last_eval = {k: evals[-1].get(k) for k in EVAL_KEYS}

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

    def evaluation_due(self, done: int) -> bool:
        """Whether an evaluation follows once ``done`` steps are done: every ``eval_every``, and the last."""
        return done % self.resolved.eval_every == 0 or done == self.resolved.total_steps

    def checkpoint_due(self, done: int) -> bool:
        """Whether a checkpoint follows once ``done`` steps are done: every --checkpoint-every, and the
        last."""
        every = self.cfg.checkpoint_every
        return bool(every) and (done % every == 0 or done == self.resolved.total_steps)

    def boundary(self, step: int) -> bool:
        """After this step something is due (evaluation, checkpoint, test hook, an actor's SIGTERM mark;
        ``drains``: whether the actors go quiet for it)."""
        done = step + 1
        return (self.evaluation_due(done) or self.checkpoint_due(done) or self.on_step is not None
                or self.preempted is not None)

    def drains(self, step: int) -> bool:
        """Whether the boundary after this step lets the actors go quiet (``flush``): all but a checkpoint
        that nothing else needs them quiet for (no evaluation, test hook, preemption mark or scaling policy
        that watches the cluster; not the last step; not ``RAYCONV_SYNC_CHECKPOINTS=1``), whose calls are
        queued behind the step (``driver.saving``)."""
        done = step + 1
        return self.boundary(step) and (
            not self.checkpoint_due(done) or self.evaluation_due(done) or self.on_step is not None
            or self.preempted is not None or self.scaling.watches_cluster or saving.synchronous())


@dataclass
class _Attempt:
    """The clock and display of one attempt's steps."""

    start: int
    progress: Progress
    t_train: float = field(default_factory=time.perf_counter)
    t_last: float = 0.0  # when the previous result came back
    lrs: dict[int, float] = field(default_factory=dict)  # submitted steps' learning rates
    write_at: int = -1   # the step whose row completes the metrics written at a checkpoint not drained
    drain: Optional[DrainWatch] = None   # (--elastic: the actors' nodes, looked at for a drain)


def train(run: Run, actor_group: ActorGroup, start: int) -> Decision:
    """Steps ``start`` .. total_steps - 1, with evaluations and checkpoints (see the module docstring),
    until the last step (``CONTINUE``) or a step boundary where the scaling policy decides a resize
    (returned; the actors quiet, the checkpoint of a preemption not yet written). Raises ClusterError
    (an actor failed or a call timed out) or FloatingPointError (a loss not finite)."""
    total = run.resolved.total_steps
    if not run.images_logged:
        log_images(run)
    att = _Attempt(start, Progress(run.cfg, total, start, run.log))
    if run.scaling.watches_cluster:
        att.drain = DrainWatch({i["node_id"] for i in actor_group.info})
    att.t_last = att.t_train
    log, run.log = run.log, att.progress.console(run.log)   # (lines printed while the bar shows: not onto it)
    saving.begin_attempt(run, actor_group)
    try:
        in_flight: Optional[Pending] = None
        for step in range(start, total):
            if in_flight is None:
                in_flight = _submit(run, actor_group, att, step)
            current, in_flight = in_flight, None
            # (decided before the result: a SIGTERM mark in it makes the next step the boundary)
            drains = run.drains(step)
            if run.boundary(step) and not drains:   # a checkpoint only: its calls queued behind the step
                checkpoint(run, actor_group, step + 1, queued=True)
                att.write_at = step
            if not drains:  # queue the next step before waiting for this one
                in_flight = _submit(run, actor_group, att, step + 1)
            _record(run, att, actor_group.collect(current, timeout_s=run.call_timeout_s))
            decision = _between_steps(run, actor_group, att, step) if drains else CONTINUE
            if decision.action != "continue":
                saving.settle(run, actor_group)   # (the checkpoint complete before these actors stop)
                return decision
        saving.settle(run, actor_group)   # (the run ends once its last checkpoint is complete)
        return CONTINUE
    except KeyboardInterrupt:   # (a stop keeps the checkpoints being written, if they can be finished)
        saving.settle(run, actor_group, timeout_s=run.call_timeout_s, quiet=True)
        raise
    finally:
        att.progress.close()
        run.log = log
        run.train_s += time.perf_counter() - att.t_train


def _submit(run: Run, actor_group: ActorGroup, att: _Attempt, step: int) -> Pending:
    att.lrs[step] = learning_rate(run.cfg, step, run.resolved.total_steps,
                                  run.resolved.sharding.steps_per_epoch)
    return actor_group.submit(Actor.train_step, step, att.lrs[step])


def _record(run: Run, att: _Attempt, results: list) -> None:
    """The step whose metrics came back (``_row``; a call that returned none is skipped), then the
    checkpoints' poll (``saving.note``: the parts written came with them)."""
    results = [x for x in results if x is not None]
    if results:
        _row(run, att, results)
    saving.note(run, results)


def _row(run: Run, att: _Attempt, results: list) -> None:
    """Log the step of ``results``: its metrics row, progress and gauges. Raises FloatingPointError when
    its loss is not finite."""
    marks = [x["preempted"] for x in results if x.get("preempted")]
    if marks and run.preempted is None:
        run.preempted = f"actor {marks[0]} got SIGTERM"
    now = time.perf_counter()
    wall_s, att.t_last = now - att.t_last, now
    r, k, epoch = reduce_step(results), results[0]["step"], results[0]["epoch"]
    count = results[0]["global_count"]
    run.wall[k] = (count, wall_s)
    ips = att.progress.rate(count, wall_s, first=k == att.start)
    # The row: the step's own time, measured in the actors (the driver's wall time between two
    # results can belong partly to the neighbouring step with two in flight).
    step_ms = r["step_ms"] if r["step_ms"] is not None else wall_s * 1e3
    stall = r["input_stall_ms"]
    run.metrics.add(kind="train", step=k, epoch=epoch, loss=r["loss"], lr=att.lrs.pop(k),
                    images_per_s=count / max(1e-9, step_ms / 1e3), step_ms=step_ms, input_stall_ms=stall,
                    input_stall_fraction=None if stall is None else stall / max(1e-9, step_ms),
                    time_s=run.train_s + now - att.t_train, loss_scale=r["loss_scale"],
                    layout=run.layout_name)
    run.changes.settle(run.log)   # (a layout change's first step done: its line and row)
    if att.drain is not None and run.preempted is None:
        run.preempted = att.drain.draining()
    if run.cfg.metrics:
        actor_gauges(run.resolved.run_name, "driver", images_per_s=ips, step_ms=step_ms, loss=r["loss"],
                     step=k)
    if not math.isfinite(r["loss"]):
        raise FloatingPointError(f"loss is {r['loss']} at step {k}: lower --lr (now {run.cfg.lr})")
    att.progress.step(k, epoch, r["loss"], run.metrics.rows[-1]["lr"], ips, run.last_eval)
    _startup(run, k, results)
    if k == att.write_at:   # (the progress so far, with a checkpoint not drained: written in the background)
        run.metrics.write_soon(run.resolved.out / "metrics.parquet")


def _startup(run: Run, k: int, results: list) -> None:
    """The start-up clock: the run's first step done (and its console line), the CUDA-graph capture."""
    clock = run.startup
    if "first_step" not in clock.phases:
        clock.mark("first_step")
        run.log(clock.line(k))
    clock.mark_capture([x["graph_capture_s"] for x in results if x.get("graph_capture_s") is not None])


def _between_steps(run: Run, actor_group: ActorGroup, att: _Attempt, step: int) -> Decision:
    """After ``step``, with nothing in flight: the actors' last metrics, then the evaluation, the
    checkpoint, the metrics so far and the test hook that are due; then the scaling policy's decision."""
    cfg, s, done = run.cfg, run.resolved, step + 1
    _record(run, att, actor_group.call(Actor.flush, timeout_s=run.call_timeout_s))
    if run.evaluation_due(done):
        _evaluation(run, actor_group, att, step)
    if run.checkpoint_due(done):
        checkpoint(run, actor_group, done)
    if done % s.eval_every == 0 or cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
        # the progress so far, readable mid-run: written while the next steps run
        run.metrics.write_soon(s.out / "metrics.parquet")
    if run.on_step is not None:
        run.metrics.wait()   # (the hook sees the file written)
        saving.settle(run, actor_group)   # (and the checkpoint complete)
        run.on_step(actor_group, step)
    att.t_last = time.perf_counter()  # evaluation and checkpoint time is not a step's
    free = cluster_free(cfg) if run.scaling.watches_cluster else 0
    return run.scaling.at_boundary(done, s.total_steps, run.checkpoint_due(done), s.mesh, free, run.preempted)


def _evaluation(run: Run, actor_group: ActorGroup, att: _Attempt, step: int) -> None:
    """The evaluation after ``step`` (and of the moving average with --model-ema): its metrics row,
    the progress line, and the time to --target-accuracy if this is the first to reach it. With
    --val-split the validation images, and the test split where ``evaluates_test``."""
    s, cfg = run.resolved, run.cfg
    ev: dict[str, Optional[float]] = {}
    if cfg.precise_bn_batches:   # (statistics recomputed under the weights evaluated: actor/precise_bn.py)
        ema = cfg.model_ema and evaluates_test(cfg, step, s.total_steps)
        actor_group.call(Actor.recalibrate_bn, step + 1, ema, timeout_s=run.call_timeout_s)
    if cfg.val_split > 0:
        ev.update(evaluate(actor_group, run.call_timeout_s, split="val"))
    if evaluates_test(cfg, step, s.total_steps):
        ev.update(evaluate(actor_group, run.call_timeout_s))
        if cfg.model_ema:
            ev["ema_test_accuracy"] = evaluate(actor_group, run.call_timeout_s, ema=True)["test_accuracy"]
    run.last_eval = ev
    metric = selection_metric(cfg)
    since = time.monotonic() - run.startup.origin
    if run.target.update(step, ev.get(metric), time.perf_counter() - s.t_start, train_seconds(run.wall, step),
                         since):
        run.log(f"rayconv: {metric.replace('_', ' ')} {ev[metric]:.4f} reached --target-accuracy "
                f"{run.target.accuracy:g} after step {step}: {run.target.wall_s:.1f} s from the start, "
                f"{run.target.train_s:.1f} s of training")
    if cfg.keep_best and run.best.improves(ev.get("val_accuracy")):
        write_best(s.out, step, float(ev["val_accuracy"]), lambda path: export(run, actor_group, path))
        run.best = Best(step, ev["val_accuracy"])
    run.metrics.add(kind="eval", step=step, epoch=step // s.sharding.steps_per_epoch,
                    time_s=run.train_s + time.perf_counter() - att.t_train, layout=run.layout_name,
                    **run.last_eval)
    att.progress.evaluation(step, run.metrics.last("train", "loss"), run.last_eval)
    if run.on_eval is not None:
        run.on_eval({**run.metrics.rows[-1], "train_loss": run.metrics.last("train", "loss")}, s.total_steps)


def evaluates_test(cfg: Any, step: int, total_steps: int) -> bool:
    """Whether the evaluation after ``step`` includes the test split: always without --val-split; with
    it at the last step, or at every evaluation with --eval-test."""
    return cfg.val_split == 0 or cfg.eval_test or step + 1 == total_steps


def selection_metric(cfg: Any) -> str:
    """The accuracy --target-accuracy reads: ``val_accuracy`` with --val-split, else ``test_accuracy``."""
    return "val_accuracy" if cfg.val_split > 0 else "test_accuracy"


def evaluate(actor_group: ActorGroup, timeout_s: Optional[float] = None, ema: bool = False,
             split: str = "test") -> dict[str, Optional[float]]:
    """Test loss, error, top-1 and top-5 accuracy over every held-out sample once (summed over
    replicas); top-5 is None below 5 classes. ``ema``: of the actors' moving average of the weights.
    ``split`` "val": --val-split's images, as ``val_loss``, ``val_accuracy``, ``val_top5_accuracy``."""
    res = [r for r in actor_group.call(Actor.evaluate, ema, split, timeout_s=timeout_s) if r["reports"]]
    return eval_figures(res, split)


def eval_figures(res: list[dict[str, Any]], split: str = "test") -> dict[str, Optional[float]]:
    """The figures of the reporting actors' ``evaluate`` results ``res`` (loss_sum, correct, correct5,
    samples each), keyed ``<split>_loss``, ``<split>_accuracy``, ``<split>_top5_accuracy`` (and
    ``test_error`` for the test split)."""
    n = sum(r["samples"] for r in res)
    correct = sum(r["correct"] for r in res)
    top5 = (None if any(r.get("correct5") is None for r in res)
            else sum(r["correct5"] for r in res) / max(1, n))
    out = {f"{split}_loss": sum(r["loss_sum"] for r in res) / max(1, n),
           f"{split}_accuracy": correct / max(1, n), f"{split}_top5_accuracy": top5}
    if split == "test":
        out["test_error"] = 1.0 - correct / max(1, n)
    return out


def log_images(run: Run) -> None:
    """--log-images N: a grid of the first N augmented images of the first training batch in the
    event files, once (skipped, with a note, where reading them here is not cheap)."""
    run.images_logged = True
    s = run.resolved
    x = first_images(s.source, s.sharding.global_batch(0, 0), run.cfg.log_images)
    if x is None:
        run.log("rayconv: --log-images skipped: the driver reads no images of data held on the device (it "
                "would decode all of it here) or in object storage (it would fetch the shards here)")
        return
    run.events.add_image_grid(x)


def checkpoint(run: Run, actor_group: ActorGroup, step: int, wait: bool = False, queued: bool = False) -> Any:
    """Start checkpoints/step-<step>/ (``step`` steps done): the actors write their parts in the
    background; its manifest, written once all are in, completes it (``driver.saving``). ``queued``: its
    calls queued behind the step in flight; ``wait``: complete on return. Returns its folder."""
    return saving.start(run, actor_group, step, saving.manifest_of(run, step), wait=wait, queued=queued)


def export(run: Run, actor_group: ActorGroup, path: Path, ema: bool = False) -> None:
    """``path`` <- the actors' parts (``ema``: of their moving averages) assembled into one state_dict,
    checked against the keys and shapes of the model an actor built (as a fresh model's strict
    ``load_state_dict`` would: the driver builds no model, and imports no torchvision), written atomically."""
    cfg, mesh = run.cfg, run.resolved.mesh
    # Replica 0's actors hold the whole model between them.
    # (Under the per-layer plan every actor holds a slice of the FC layers.)
    holders = list(range(mesh.world_size)) if cfg.plan != "none" else \
        [mesh.rank((0, p, f)) for p in range(mesh.pp) for f in range(mesh.fs)]
    states = actor_group.call(Actor.model_state, *((True,) if ema else ()), ranks=holders,
                              timeout_s=run.call_timeout_s)
    split_dims: dict[str, int] = {}
    for d in actor_group.call(Actor.split_dims, ranks=holders, timeout_s=run.call_timeout_s):
        split_dims.update(d)
    keys = actor_group.call(Actor.model_keys, ranks=holders[:1], timeout_s=run.call_timeout_s)[0]
    export_model(path, assemble(states, split_dims), keys)

"""What a run prints: the header, then a progress bar on a terminal or plain lines in a log file.

The header names the model, data, layout, device, batch, steps and output folder; how Ray was reached
(attached to a running cluster, or a local one started) and its dashboard's address (or that Ray could not
start it); the images (channels and side as the source gives them, the augmentation) and the recipe
(optimizer, learning rate and its warm-up, the other recipe settings that are on); for a pipeline, its
stages and schedule grid, with a note when too few micro-batches leave the stages taking turns.
During training a tqdm bar shows loss, images/s and the last test accuracy when stderr is a terminal
and ``--progress`` is on; otherwise a line every ``--log-every`` steps and one per evaluation.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Optional

from tqdm import tqdm

from rayconv.cluster.connect import cli_address, cluster_origin, dashboard_failed, dashboard_url
from rayconv.config import Config, batch_split_problem
from rayconv.driver.lr import peak_lr, warmup_steps
from rayconv.driver.prestart import ray_job
from rayconv.driver.resolve import ResolvedRun
from rayconv.mesh import Mesh
from rayconv.parallel.routing import Routing
from rayconv.parallel.pipeline.simulate import bubble_fraction, format_grid
from rayconv.settings import OutputSettings
from rayconv.storage import describe

RATE_WINDOW = 20  # steps: the progress line's images/s is over the wall-clock of the last 20


def log_header(resolved: ResolvedRun, log=print) -> None:
    """The lines a run starts with (see the module docstring)."""
    cfg, mesh = resolved.cfg, resolved.mesh
    log(run_line(resolved))
    log(f"rayconv: Ray: {cluster_origin()}")
    dashboard = dashboard_line(dashboard_url(), dashboard_failed())
    if dashboard:
        log(dashboard)
    log(images_line(resolved))
    log(recipe_line(resolved))
    if resolved.resume is not None:
        log(f"rayconv: resuming from {resolved.resume.path} (step {resolved.resume.step} of "
            f"{resolved.total_steps})")
    if mesh.pp > 1:
        chunks = (f", interleaved: {cfg.virtual_stages} model chunks per stage (stage s holds chunks s, s + "
                  f"{mesh.pp}, ...)" if cfg.virtual_stages > 1 else "")
        micro = f"{cfg.num_microbatches} micro-batch{'es' if cfg.num_microbatches > 1 else ''}"
        log(f"pipeline stages {list(resolved.routing.stages)}, schedule {cfg.schedule}{chunks}, {micro}:\n"
            f"{format_grid(resolved.routing.schedule)}")
        note = overlap_note(cfg, mesh, resolved.routing)
        if note:
            log(note)


def dashboard_line(url: Optional[str], failed: bool) -> Optional[str]:
    """The header's line on the cluster's Ray dashboard: its address ``url``; where there is none, that none
    runs when Ray could not start it (``failed``: Ray printed why); None (no line) where none runs by
    choice (``connect.dashboard_failed``)."""
    if url:
        return f"rayconv: Ray dashboard: {url}"
    return "rayconv: Ray dashboard: not running (Ray could not start it; the run goes on)" if failed else None


def run_line(resolved: ResolvedRun) -> str:
    """The header's first line: model, data, layout, device, batch, the steps (or, with --evaluate-only,
    the weights evaluated), the output folder in full, the run's name on the cluster (and the Ray job's)."""
    cfg, mesh, source, n = resolved.cfg, resolved.mesh, resolved.source, resolved.total_steps
    work = f"evaluating --init {cfg.init} only (no training steps)" if cfg.evaluate_only else \
        f"global batch {cfg.global_batch_size}, {n} step{'s' if n != 1 else ''}"
    job = ray_job()
    held = len(resolved.sharding.val_indices())
    train = (f"{resolved.sharding.train_samples} train + {held} validation" if held
             else f"{source.train_size} train")
    return (f"rayconv: {cfg.model} on {cfg.data} ({train} / {source.test_size} test images, "
            f"{source.num_classes} classes), layout {mesh.describe()}"
            f"{' plan ' + cfg.plan if cfg.plan != 'none' else ''} on {cfg.device}, {work} -> "
            f"{describe(resolved.out)}; {f'Ray job {job}, ' if job else ''}Ray run name {resolved.run_name}")


def kept_names(names: list[str], run_name: str) -> str:
    """What the reuse line adds for kept actors named ``names`` (rank order): Ray renames no named actor,
    so they keep the names of the run that started them, not ``rayconv/<run_name>/<role>``; the
    line says which, and how to list them (the cluster's address given as RAY_ADDRESS where Ray's command
    line would not find it by itself: ``cluster.connect.cli_address``)."""
    if not names or names[0].startswith(f"rayconv/{run_name}/"):
        return ""
    prefix, address = names[0].rsplit("/", 1)[0], cli_address()
    at = f"RAY_ADDRESS={address} " if address else ""
    return (f"; on the cluster they keep the names {prefix}/<role> of the run that started them "
            f"(`{at}ray list actors --filter \"name={names[0]}\"`)")


def images_line(resolved: ResolvedRun) -> str:
    """The images the model sees: channels x side x side (the source's), and the augmentation (the
    source's own name for it where it tells one, else the --augment setting and what auto resolves to)."""
    cfg, shape = resolved.cfg, tuple(resolved.source.sample_shape)
    channels = cfg.channels or shape[0]
    told = getattr(resolved.source, "augmentation", None)  # (a source that names what it does)
    augment = f"augmentation {told}" if told else \
        f"--augment {cfg.augment}" + (f" ({cfg.augmentation})" if cfg.augment == "auto" else "")
    erase = f", random erasing p={cfg.random_erase:g}" if cfg.random_erase and not told else ""
    return (f"rayconv: images {channels} x {shape[1]} x {shape[2]}"
            f"{f' (the data has {shape[0]} channel(s))' if channels != shape[0] else ''}, "
            f"{augment}{erase}, precision {cfg.precision}")


def recipe_line(resolved: ResolvedRun) -> str:
    """The optimizer, the learning rate (peak, schedule, warm-up in steps) and the recipe settings on."""
    cfg = resolved.cfg
    warm = warmup_steps(cfg, resolved.sharding.steps_per_epoch)
    scaled = f" (--lr {cfg.lr:g} per 256 images)" if cfg.lr_scaling == "linear" else ""
    lars = f" (trust coefficient {cfg.lars_trust_coefficient:g})" if cfg.opt == "lars" else ""
    parts = [f"optimizer {cfg.opt}{lars}, lr {peak_lr(cfg):.4g}{scaled} {cfg.lr_schedule}"
             + (f" after {warm} warm-up steps ({cfg.lr_warmup_method} from x{cfg.lr_warmup_decay:g})"
                if warm else "")]
    parts.append(f"weight decay {cfg.weight_decay:g}" + "".join(
        f", {name} {v:g}" for name, v in (("norms", cfg.norm_weight_decay), ("biases", cfg.bias_weight_decay))
        if v is not None))
    on = {"label smoothing": cfg.label_smoothing, "mixup alpha": cfg.mixup_alpha,
          "cutmix alpha": cfg.cutmix_alpha, "clip grad norm": cfg.clip_grad_norm}
    parts += [f"{name} {v:g}" for name, v in on.items() if v]
    if cfg.model_ema:
        parts.append(f"EMA every {cfg.model_ema_steps} steps, decay {cfg.model_ema_decay:g}")
    if cfg.zero_init_residual:
        parts.append("zero-init residual")
    if cfg.bn_momentum is not None:
        parts.append(f"batch-norm momentum {cfg.bn_momentum:g}")
    if cfg.precise_bn_batches:
        parts.append(f"precise BN over {cfg.precise_bn_batches} batches")
    if cfg.target_accuracy is not None:
        parts.append(f"target accuracy {cfg.target_accuracy:g}")
    return "rayconv: " + ", ".join(parts)


def overlap_note(cfg: Config, mesh: Mesh, routing: Routing) -> Optional[str]:
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
            f"{bubble_fraction(routing.schedule):.0%} of the step); --num-microbatches {better[0]} lets them "
            "overlap")


class Progress:
    """One attempt's progress display: the bar (or plain lines) and the rate it shows.

    The rate is images over the wall-clock of the last RATE_WINDOW results (the attempt's first, which
    compiles, left out once 4 more came back). With two steps in flight a result's wall time can hold
    its neighbour's step (or none, just after an evaluation); over several it evens out."""

    def __init__(self, cfg: OutputSettings, total_steps: int, start: int, log=print):
        self.cfg, self.total_steps, self.log = cfg, total_steps, log
        self.window: deque = deque(maxlen=RATE_WINDOW)
        # A progress bar on a terminal; plain progress lines every --log-every steps otherwise (a log file).
        self.use_bar = cfg.progress and sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, initial=start, desc="train", unit="step", disable=not self.use_bar,
                        dynamic_ncols=True, mininterval=1.0)
        self.eval_step: Optional[int] = None   # the step after which this attempt last evaluated

    def rate(self, images: int, wall_s: float, first: bool) -> float:
        """Images/s over the window, after adding a result of ``images`` in ``wall_s`` seconds
        (``first``: the attempt's first step)."""
        self.window.append((images, wall_s, first))
        recent = list(self.window)[1:] if self.window[0][2] and len(self.window) > 4 else self.window
        return sum(n for n, _, _ in recent) / max(1e-9, sum(w for _, w, _ in recent))

    def step(self, k: int, epoch: int, loss: float, lr: float, ips: float, last_eval: dict) -> None:
        """Step ``k``'s result: the bar moves, or a plain line every --log-every steps and at the last
        (with the accuracy of the attempt's last evaluation, ``last_eval``, and the step it followed)."""
        name, acc = _last_accuracy(last_eval)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{ips:.0f}",
                             **({name: f"{acc:.4f}"} if acc is not None else {}))
        if not self.use_bar and (k % self.cfg.log_every == 0 or k + 1 == self.total_steps):
            # (the accuracy is the last evaluation's, named with its step: not this step's)
            known = acc is not None and self.eval_step is not None
            self.log(f"step {k:5d} epoch {epoch:3d} loss {loss:.4f} lr {lr:.4g} {ips:8.0f} images/s"
                     + (f" ({name} {acc:.4f} after step {self.eval_step})" if known else ""))

    def evaluation(self, step: int, train_loss: float, ev: dict) -> None:
        """An evaluation after ``step``: on the bar, or a plain line with the validation and test loss and
        accuracies evaluated (also the moving average's, with --model-ema)."""
        name, acc = _last_accuracy(ev)
        self.eval_step = step
        self.bar.set_postfix(loss=f"{train_loss:.4f}", **({name: f"{acc:.4f}"} if acc is not None else {}))
        if not self.use_bar:
            self.log(f"step {step:5d} " + eval_line(ev))

    def console(self, log):
        """``log`` for the lines a run prints while the bar is shown: each written with the bar cleared
        first and drawn again after it (tqdm's ``external_write_mode``), not onto the bar's line."""
        if not self.use_bar:
            return log

        def write(line: str) -> None:
            with self.bar.external_write_mode(file=sys.stdout):
                log(line)
        return write

    def close(self) -> None:
        self.bar.close()


EVAL_LINE = ("val_loss", "val_accuracy", "val_top5_accuracy", "test_loss", "test_accuracy",
             "test_top5_accuracy", "ema_test_accuracy")


def eval_line(ev: dict) -> str:
    """The console's evaluation figures: ``name value`` for each of ``EVAL_LINE`` that ``ev`` holds."""
    return " ".join(f"{k} {ev[k]:.4f}" for k in EVAL_LINE if ev.get(k) is not None)


def _last_accuracy(ev: Optional[dict]) -> tuple[str, Optional[float]]:
    """(short name, value) of the evaluation's validation accuracy, else its test accuracy."""
    for key, name in (("val_accuracy", "val_acc"), ("test_accuracy", "test_acc")):
        if ev and ev.get(key) is not None:
            return name, ev[key]
    return "test_acc", None

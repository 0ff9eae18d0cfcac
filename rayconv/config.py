"""The run configuration: one flat dataclass, its validation and its command-line form.

Every field is a flag of ``python -m rayconv.run`` (``global_batch_size`` is ``--global-batch-size``)
and a key of a JSON config file (``--config FILE``; flags given on the command line win). The resolved
configuration is written to ``<out>/config.json`` and can be passed back with ``--config``.

Errors a user can cause raise :class:`ConfigError` (a ``ValueError``) whose message names the flag
and what to change. A Config is frozen: ``validate()`` checks it and returns it; what the driver
resolves later (the device, ``dp``, the pipeline cut, the output folder) makes a new one with
``dataclasses.replace``. The module imports only ``errors``, so that every layer can read settings;
``--resume``'s checkpoint is read by the command line (``rayconv.run``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from rayconv.errors import ConfigError

MODELS_HELP = ("convnet (small test ConvNet; convnet_bn with batch norm; convnet2col two-column), alexnet, "
               "alexnet2012 (two-column), or any torchvision classification ConvNet name")
DATA_CHOICES = ("digits", "fashion-mnist", "synthetic", "imagefolder", "shards")
DECODE_CHOICES = ("auto", "cpu", "gpu")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
SCHEDULE_CHOICES = ("gpipe", "1f1b")
PLAN_CHOICES = ("none", "krizhevsky2014")
PRECISION_CHOICES = ("fp32", "bf16", "fp64")
LR_SCHEDULE_CHOICES = ("constant", "cosine")
COMPILE_CHOICES = ("auto", "on", "off")
BALANCE_CHOICES = ("auto", "time", "flops")
LAYOUT_CHOICES = ("manual", "auto")


def batch_split_problem(global_batch_size: int, dp: int, num_microbatches: int) -> Optional[str]:
    """What is wrong with splitting the global batch over ``dp`` replicas and each replica's share into
    ``num_microbatches`` equal micro-batches (None when nothing is): the message says what to change."""
    if global_batch_size < dp:
        return (f"--global-batch-size {global_batch_size} is smaller than --dp {dp}: "
                f"each replica needs at least one sample; raise it to >= {dp}")
    per_replica = global_batch_size // dp
    if per_replica < num_microbatches:
        return (f"--num-microbatches {num_microbatches} exceeds the per-replica batch {per_replica}: "
                "lower it or raise --global-batch-size")
    if global_batch_size % dp == 0 and per_replica % num_microbatches != 0:
        return (f"--num-microbatches {num_microbatches} does not divide the per-replica batch {per_replica} "
                f"(= --global-batch-size {global_batch_size} / dp {dp}): choose a divisor")
    return None


@dataclass(frozen=True)
class Config:
    """Settings of one training run, frozen (``dataclasses.replace`` makes a changed copy). Units are
    given per field."""

    # what to train
    model: str = field(default="convnet", metadata={"help": MODELS_HELP})
    data: str = field(default="digits", metadata={"help": "digits (embedded real scans), fashion-mnist (apt-get install dataset-fashion-mnist, or its idx files in --data-dir), synthetic, imagefolder, "
                                                          "shards (a folder from python -m rayconv.prepare)",
                                                  "choices": DATA_CHOICES})
    data_dir: Optional[str] = field(default=None, metadata={"help": "ImageNet-layout folder with train/ and val/, "
                                                                   "or a prepared shard folder"})
    decode: str = field(default="auto", metadata={
        "help": "where --data shards decodes JPEGs: gpu (batched nvJPEG, crop and flip on the actor's GPU), "
                "cpu (--loader-workers processes, libjpeg-turbo), auto: cpu (measured faster on an H200 with "
                "14 workers: nvJPEG and the crops take GPU time from the model)",
        "choices": DECODE_CHOICES})
    num_classes: Optional[int] = field(default=None, metadata={"help": "classes; default: follows the data"})
    image_size: int = field(default=224, metadata={"help": "side in pixels of the training images (synthetic data, and the crops of imagefolder and shards data)"})
    synthetic_samples: int = field(default=4096, metadata={"help": "train samples of synthetic data"})
    # layout: a mesh of dp * pp * fs actors
    dp: Optional[int] = field(default=None, metadata={"help": "data-parallel replicas; default: all devices / (pp*fs)"})
    pp: int = field(default=1, metadata={"help": "pipeline stages (model split by layers)"})
    fs: int = field(default=1, metadata={"help": "filter split: output channels of each layer over fs actors"})
    exchange_chunks: int = field(default=1, metadata={
        "help": "filter split: gather the input of each layer that needs all channels in this many pieces "
                "along the batch, so that one piece's exchange runs while the layer computes another "
                "(forward and backward); 1: one exchange per layer, waited for"})
    plan: str = field(default="none", metadata={"help": "per-layer plan; krizhevsky2014 = conv data parallel, FC split",
                                                "choices": PLAN_CHOICES})
    stages: Optional[str] = field(default=None, metadata={"help": "pipeline cut points by hand, e.g. '5,9' (layer indices)"})
    balance: str = field(default="auto", metadata={
        "help": "what pipeline stages balance when --stages is not given: time (each layer's forward+backward "
                "measured on one device before the run), flops (forward FLOPs), auto (time on GPUs, flops on CPU)",
        "choices": BALANCE_CHOICES})
    num_microbatches: int = field(default=1, metadata={"help": "micro-batches per replica per step"})
    schedule: str = field(default="1f1b", metadata={"help": "pipeline schedule", "choices": SCHEDULE_CHOICES})
    virtual_stages: int = field(default=1, metadata={
        "help": "model chunks per pipeline stage: above 1, interleaved 1F1B (Megatron-LM), a smaller bubble "
                "for more point-to-point messages; needs --num-microbatches a multiple of --pp"})
    layout: str = field(default="manual", metadata={
        "help": "auto: the planner (python -m rayconv.plan) measures layer and link times, ranks every layout "
                "and runs the fastest that fits --max-memory-gib, replacing --dp/--pp/--fs/--plan/"
                "--num-microbatches/--schedule/--virtual-stages; manual: those flags", "choices": LAYOUT_CHOICES})
    max_memory_gib: Optional[float] = field(default=None, metadata={
        "help": "refuse (exit 2, before any actor starts) a layout whose predicted peak memory per device "
                "exceeds this many GiB; 6 is Yadan et al.'s TITAN (default: no limit)"})
    # optimisation (synchronous SGD)
    global_batch_size: int = field(default=64, metadata={"help": "images per step over all replicas"})
    epochs: Optional[int] = field(default=None, metadata={"help": "epochs to train (default 10 when --steps is not given)"})
    steps: Optional[int] = field(default=None, metadata={"help": "optimizer steps to train (overrides --epochs)"})
    lr: float = field(default=0.05, metadata={"help": "learning rate for the global batch"})
    lr_schedule: str = field(default="cosine", metadata={"help": "learning-rate schedule", "choices": LR_SCHEDULE_CHOICES})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=5e-4, metadata={"help": "L2 weight decay"})
    seed: int = field(default=0, metadata={"help": "seed of weights, data order and augmentation"})
    precision: str = field(default="fp32", metadata={"help": "fp32, bf16 (autocast) or fp64", "choices": PRECISION_CHOICES})
    compile: str = field(default="auto", metadata={
        "help": "torch.compile each actor's part, in segments that end at the gradient bucket size: on, off, or "
                "auto: on with GPUs (except fp64; with --cuda-graphs off, one-GPU runs only), where it was measured "
                "to pay; compile time is spent in the first step", "choices": COMPILE_CHOICES})
    cuda_graphs: str = field(default="auto", metadata={
        "help": "capture each actor's whole training step (forward, backward, exchanges, all-reduce, update) as "
                "one CUDA graph and replay it, so the CPU launches one graph a step, not every kernel: on, off, "
                "or auto: on with GPUs; refused on CPU", "choices": COMPILE_CHOICES})
    bucket_mb: float = field(default=25.0, metadata={"help": "gradient all-reduce bucket size in MB (2**20 bytes); "
                                                          "compiled segments end at bucket boundaries"})
    sync_batchnorm: bool = field(default=False, metadata={"help": "batch-norm statistics over the global batch (SyncBatchNorm, GPUs only)"})
    # where
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda", "choices": DEVICE_CHOICES})
    address: Optional[str] = field(default=None, metadata={"help": "Ray cluster address (default: RAY_ADDRESS, "
                                                                   "a running cluster, else a new local one)"})
    num_cpus_per_actor: int = field(default=1, metadata={"help": "CPUs reserved per actor (threads on CPU)"})
    all_gpus_visible: bool = field(default=True, metadata={
        "help": "actors see every GPU of their node and pick theirs by index, as torchrun does (with Ray's "
                "one GPU per actor, NCCL is reported to slow or hang on NVSwitch hosts, Ray issue 61073); "
                "no effect on CPU"})
    collective_timeout_s: float = field(default=300.0, metadata={"help": "seconds before a stuck collective fails"})
    loader_workers: Optional[int] = field(default=None, metadata={
        "help": "decode processes per actor for imagefolder data and shards decoded on the CPU; default: on "
                "GPUs the node's CPU cores per GPU less 2 (at least 2), on CPUs 2"})
    # output
    out: Optional[str] = field(default=None, metadata={"help": "output folder (default: a new folder under runs/)"})
    eval_every: Optional[int] = field(default=None, metadata={"help": "steps between test evaluations (default: each epoch)"})
    log_every: int = field(default=10, metadata={"help": "steps between progress lines"})
    progress: bool = field(default=True, metadata={"help": "a progress bar on a terminal (plain lines every --log-every steps otherwise)"})
    # operations: checkpoints, resume, recovery, dashboard metrics
    checkpoint_every: int = field(default=0, metadata={"help": "steps between checkpoints written to "
                                                               "<out>/checkpoints/step-<k>/ (0: none)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "newest checkpoints kept; older ones are deleted "
                                                               "(0: keep all)"})
    resume: Optional[str] = field(default=None, metadata={"help": "continue from a checkpoint: a run folder (its "
                                                                 "newest checkpoint) or a checkpoints/step-<k> folder; "
                                                                 "settings come from it, flags given override them"})
    max_failures: int = field(default=0, metadata={"help": "actor failures (process or node lost, collective "
                                                           "timeout) to recover from by restarting the actors and "
                                                           "reloading the last checkpoint"})
    max_wait: float = field(default=120.0, metadata={"help": "seconds the start-up may take: the cluster having "
                                                            "resources for all actors, then the actors starting "
                                                            "(at start and after a failure)"})
    metrics: bool = field(default=True, metadata={"help": "export per-actor and per-run gauges to Ray's "
                                                          "metrics (dashboard Metrics view, Prometheus)"})

    # ------------------------------------------------------------------ validation
    def validate(self) -> "Config":
        """Check what can be checked without a cluster or data; return self (validated, and frozen as
        every Config is). Raises ConfigError naming the flag and what to change."""
        _check_names(self)
        _check_numbers(self)
        _check_combinations(self)
        return self

    @property
    def world_size(self) -> int:
        """Actors in the mesh: dp * pp * fs (dp must be resolved)."""
        assert self.dp is not None, "dp is resolved against the cluster first"
        return self.dp * self.pp * self.fs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_names(cfg: Config) -> None:
    """Every choice among the known ones, and the choices that need GPUs or a data folder."""
    _need(cfg.data in DATA_CHOICES, f"unknown --data {cfg.data!r}: choose one of {', '.join(DATA_CHOICES)}")
    _need(cfg.device in DEVICE_CHOICES, f"unknown --device {cfg.device!r}: choose auto, cpu or cuda")
    _need(cfg.schedule in SCHEDULE_CHOICES, f"unknown --schedule {cfg.schedule!r}: choose gpipe or 1f1b")
    _need(cfg.plan in PLAN_CHOICES, f"unknown --plan {cfg.plan!r}: choose one of {', '.join(PLAN_CHOICES)}")
    _need(cfg.precision in PRECISION_CHOICES, f"unknown --precision {cfg.precision!r}: choose fp32, bf16 or fp64")
    _need(cfg.layout in LAYOUT_CHOICES, f"unknown --layout {cfg.layout!r}: choose manual or auto")
    _need(cfg.balance in BALANCE_CHOICES, f"unknown --balance {cfg.balance!r}: choose auto, time or flops")
    _need(cfg.compile in COMPILE_CHOICES, f"unknown --compile {cfg.compile!r}: choose auto, on or off")
    _need(cfg.cuda_graphs in COMPILE_CHOICES, f"unknown --cuda-graphs {cfg.cuda_graphs!r}: choose auto, on or off")
    _need(not (cfg.cuda_graphs == "on" and cfg.device == "cpu"),
          "--cuda-graphs on needs GPUs (CUDA graphs): drop it on CPU (--device cpu, or a cluster "
          "without GPUs)")
    _need(not (cfg.sync_batchnorm and cfg.device == "cpu"),
          "--sync-batchnorm needs GPUs (torch's SyncBatchNorm runs on CUDA only): drop it on CPU (--device "
          "cpu, or a cluster without GPUs; batch norm then uses per-replica statistics, as DDP)")
    _need(cfg.lr_schedule in LR_SCHEDULE_CHOICES, f"unknown --lr-schedule {cfg.lr_schedule!r}: constant or cosine")
    _need(cfg.data != "imagefolder" or bool(cfg.data_dir),
          "--data imagefolder needs --data-dir DIR (a folder with train/<class>/<images> and val/<class>/<images>)")
    _need(cfg.data != "shards" or bool(cfg.data_dir),
          "--data shards needs --data-dir SHARDS (a folder written by python -m rayconv.prepare DIR --out SHARDS)")
    _need(cfg.decode in DECODE_CHOICES, f"unknown --decode {cfg.decode!r}: choose auto, cpu or gpu")
    _need(not (cfg.decode == "gpu" and cfg.device == "cpu"),
          "--decode gpu decodes on the actors' GPUs: use --decode cpu with --device cpu")


def _check_numbers(cfg: Config) -> None:
    """Counts at least 1 (0 where it means none), rates, sizes and times positive, the batch split
    evenly (when --dp is given)."""
    for name in ("pp", "fs", "num_microbatches", "virtual_stages", "global_batch_size", "log_every",
                 "num_cpus_per_actor", "exchange_chunks"):
        _need(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    for name in ("dp", "steps", "epochs", "eval_every", "num_classes"):
        v = getattr(cfg, name)
        _need(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1 (got {v})")
    if cfg.dp:  # (with --dp left to the cluster, these are checked once it is known)
        problem = batch_split_problem(cfg.global_batch_size, cfg.dp, cfg.num_microbatches)
        _need(problem is None, problem or "")
    _need(cfg.lr > 0, f"--lr must be > 0 (got {cfg.lr})")
    _need(0 <= cfg.momentum < 1, f"--momentum must be in [0, 1) (got {cfg.momentum})")
    _need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0 (got {cfg.weight_decay})")
    _need(cfg.bucket_mb > 0, f"--bucket-mb must be > 0 (got {cfg.bucket_mb})")
    _need(cfg.collective_timeout_s > 0, "--collective-timeout-s must be > 0")
    _need(cfg.image_size >= 32, f"--image-size must be >= 32 pixels (got {cfg.image_size})")
    _need(cfg.loader_workers is None or cfg.loader_workers >= 0, "--loader-workers must be >= 0")
    _need(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 steps (got {cfg.checkpoint_every}; "
                                      "0 writes no checkpoints)")
    _need(cfg.keep_checkpoints >= 0, f"--keep-checkpoints must be >= 0 (got {cfg.keep_checkpoints}; 0 keeps all)")
    _need(cfg.max_failures >= 0, f"--max-failures must be >= 0 (got {cfg.max_failures})")
    _need(cfg.max_wait > 0, f"--max-wait must be > 0 seconds (got {cfg.max_wait})")
    _need(cfg.max_memory_gib is None or cfg.max_memory_gib > 0,
          f"--max-memory-gib must be > 0 GiB (got {cfg.max_memory_gib})")


def _check_combinations(cfg: Config) -> None:
    """Settings that only make sense together (exchange chunks with filter split, recovery with
    checkpoints, virtual stages with an interleavable pipeline, the per-layer plan alone)."""
    _need(cfg.exchange_chunks == 1 or cfg.fs > 1 or cfg.layout == "auto",
          f"--exchange-chunks {cfg.exchange_chunks} applies to filter split's gathers: add --fs 2 (or more), "
          "or drop it")
    _need(cfg.max_failures == 0 or cfg.checkpoint_every > 0 or cfg.resume is not None,
          f"--max-failures {cfg.max_failures} restarts from the last checkpoint: also set --checkpoint-every N "
          "(without checkpoints a recovery would start the run over)")
    if cfg.virtual_stages > 1:
        _need(cfg.pp >= 2, f"--virtual-stages {cfg.virtual_stages} interleaves model chunks over pipeline "
                            "stages: set --pp 2 or more, or drop --virtual-stages")
        _need(cfg.schedule == "1f1b", f"--virtual-stages {cfg.virtual_stages} runs interleaved 1F1B: use "
                                       f"--schedule 1f1b, not {cfg.schedule}, or drop --virtual-stages")
        _need(cfg.fs == 1 and cfg.plan == "none",
              f"--virtual-stages {cfg.virtual_stages} does not combine with --fs or --plan: drop one of them")
        _need(cfg.num_microbatches % cfg.pp == 0,
              f"--virtual-stages {cfg.virtual_stages} takes micro-batches in groups of --pp {cfg.pp}: set "
              f"--num-microbatches to a multiple of {cfg.pp} (got {cfg.num_microbatches})")
    if cfg.plan != "none":
        _need(cfg.pp == 1 and cfg.fs == 1,
              f"--plan {cfg.plan} spreads the model over all actors itself: drop --pp/--fs and set only --dp")


# ---------------------------------------------------------------------- command line
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (not the whole usage block) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one flag per Config field (defaults left unset to detect what was given)."""
    p = OneLineParser(
        prog="python -m rayconv.run",
        description="Train a ConvNet with synchronous SGD across Ray actors (data parallel, pipeline, filter split).",
        argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="JSON file of settings (e.g. a run's config.json); flags override it")
    for f in fields(Config):
        meta = dict(f.metadata)
        text = meta.get("help", "")
        kw: dict[str, Any] = {"help": text if "default" in text else f"{text} (default: {f.default})"}
        if f.type in ("bool", bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _parse_type(f.type)
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        p.add_argument(_flag(f.name), dest=f.name, **kw)
    return p


def _parse_type(t: Any):
    t = str(t)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def from_mapping(values: dict[str, Any]) -> Config:
    """Config from a dict; unknown keys raise ConfigError naming them."""
    known = {f.name: f for f in fields(Config)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
    if isinstance(values.get("compile"), bool):  # configs written before --compile took auto/on/off
        values = {**values, "compile": "on" if values["compile"] else "off"}
    for key, v in values.items():  # JSON gives any type: check each against the field's
        t = str(known[key].type)
        ok = (v is None and "Optional" in t) or (
            isinstance(v, bool) if "bool" in t else
            isinstance(v, int) and not isinstance(v, bool) if "int" in t else
            isinstance(v, (int, float)) and not isinstance(v, bool) if "float" in t else isinstance(v, str))
        if not ok:
            raise ConfigError(f"setting {key} = {v!r} has the wrong type: {_flag(key)} takes "
                              f"{t.replace('Optional[', '').rstrip(']')}")
    return Config(**values)


def read_settings(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """The settings of a command line: its flags over its ``--config`` file's (the file's output folder,
    checkpoint and cluster address left out), unchecked. Raises ConfigError; argparse exits 2 on a
    malformed flag."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    cfg_file = ns.pop("config", None)
    if cfg_file is not None:
        path = Path(cfg_file)
        if not path.is_file():
            raise ConfigError(f"--config {cfg_file}: no such file")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {cfg_file} is not valid JSON ({e}): fix the file") from None
        if not isinstance(values, dict):
            raise ConfigError(f"--config {cfg_file} must hold a JSON object of settings")
        # A run's config.json names its output folder (and checkpoint, cluster): a re-run is a new run,
        # into a new folder, unless flags say otherwise.
        for key in NOT_RESUMED:
            values.pop(key, None)
    return {**values, **ns}


def parse_args(argv: Optional[list[str]] = None) -> Config:
    """The validated Config of a command line (``read_settings``). ``--resume``'s checkpoint settings
    are not read here: ``rayconv.run`` puts them under the flags. Raises ConfigError."""
    return from_mapping(read_settings(argv)).validate()


# Settings a resumed run does not take over from its checkpoint: where it runs and writes.
NOT_RESUMED = ("out", "resume", "address")


def resumed_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """Of the settings saved in a checkpoint (its manifest's ``config``), those a resumed run takes
    over (flags given override them; the output folder defaults to the checkpoint's run folder)."""
    known = {f.name for f in fields(Config)}
    return {k: v for k, v in saved.items() if k in known and k not in NOT_RESUMED}

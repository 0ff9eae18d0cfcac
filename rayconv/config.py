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
DATA_CHOICES = ("digits", "synthetic", "imagefolder", "shards")
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


@dataclass
class Config:
    """Settings of one training run, frozen (``dataclasses.replace`` makes a changed copy). Units are
    given per field."""

    # what to train
    model: str = field(default="convnet", metadata={"help": MODELS_HELP})
    data: str = field(default="digits", metadata={"help": "digits (embedded real scans), synthetic, imagefolder, "
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
        every Config is). Raises ConfigError."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.data in DATA_CHOICES, f"unknown --data {self.data!r}: choose one of {', '.join(DATA_CHOICES)}")
        need(self.device in DEVICE_CHOICES, f"unknown --device {self.device!r}: choose auto, cpu or cuda")
        need(self.schedule in SCHEDULE_CHOICES, f"unknown --schedule {self.schedule!r}: choose gpipe or 1f1b")
        need(self.plan in PLAN_CHOICES, f"unknown --plan {self.plan!r}: choose one of {', '.join(PLAN_CHOICES)}")
        need(self.precision in PRECISION_CHOICES, f"unknown --precision {self.precision!r}: choose fp32, bf16 or fp64")
        need(self.layout in LAYOUT_CHOICES, f"unknown --layout {self.layout!r}: choose manual or auto")
        need(self.max_memory_gib is None or self.max_memory_gib > 0,
             f"--max-memory-gib must be > 0 GiB (got {self.max_memory_gib})")
        need(self.balance in BALANCE_CHOICES, f"unknown --balance {self.balance!r}: choose auto, time or flops")
        need(self.compile in COMPILE_CHOICES, f"unknown --compile {self.compile!r}: choose auto, on or off")
        need(self.cuda_graphs in COMPILE_CHOICES, f"unknown --cuda-graphs {self.cuda_graphs!r}: choose auto, on or off")
        need(not (self.cuda_graphs == "on" and self.device == "cpu"),
             "--cuda-graphs on needs GPUs (CUDA graphs): drop it on CPU (--device cpu, or a cluster "
             "without GPUs)")
        need(not (self.sync_batchnorm and self.device == "cpu"),
             "--sync-batchnorm needs GPUs (torch's SyncBatchNorm runs on CUDA only): drop it on CPU (--device "
             "cpu, or a cluster without GPUs; batch norm then uses per-replica statistics, as DDP)")
        need(self.lr_schedule in LR_SCHEDULE_CHOICES, f"unknown --lr-schedule {self.lr_schedule!r}: constant or cosine")
        need(self.data != "imagefolder" or bool(self.data_dir),
             "--data imagefolder needs --data-dir DIR (a folder with train/<class>/<images> and val/<class>/<images>)")
        need(self.data != "shards" or bool(self.data_dir),
             "--data shards needs --data-dir SHARDS (a folder written by python -m rayconv.prepare DIR --out SHARDS)")
        need(self.decode in DECODE_CHOICES, f"unknown --decode {self.decode!r}: choose auto, cpu or gpu")
        need(not (self.decode == "gpu" and self.device == "cpu"),
             "--decode gpu decodes on the actors' GPUs: use --decode cpu with --device cpu")
        for name in ("pp", "fs", "num_microbatches", "virtual_stages", "global_batch_size", "log_every",
                     "num_cpus_per_actor", "exchange_chunks"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        for name in ("dp", "steps", "epochs", "eval_every", "num_classes"):
            v = getattr(self, name)
            need(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1 (got {v})")
        if self.dp:  # (with --dp left to the cluster, these are checked once it is known)
            problem = batch_split_problem(self.global_batch_size, self.dp, self.num_microbatches)
            need(problem is None, problem or "")
        need(self.lr > 0, f"--lr must be > 0 (got {self.lr})")
        need(0 <= self.momentum < 1, f"--momentum must be in [0, 1) (got {self.momentum})")
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0 (got {self.weight_decay})")
        need(self.exchange_chunks == 1 or self.fs > 1 or self.layout == "auto",
             f"--exchange-chunks {self.exchange_chunks} applies to filter split's gathers: add --fs 2 (or more), "
             "or drop it")
        need(self.bucket_mb > 0, f"--bucket-mb must be > 0 (got {self.bucket_mb})")
        need(self.collective_timeout_s > 0, "--collective-timeout-s must be > 0")
        need(self.image_size >= 32, f"--image-size must be >= 32 pixels (got {self.image_size})")
        need(self.loader_workers is None or self.loader_workers >= 0, "--loader-workers must be >= 0")
        need(self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 steps (got {self.checkpoint_every}; "
                                         "0 writes no checkpoints)")
        need(self.keep_checkpoints >= 0, f"--keep-checkpoints must be >= 0 (got {self.keep_checkpoints}; 0 keeps all)")
        need(self.max_failures >= 0, f"--max-failures must be >= 0 (got {self.max_failures})")
        need(self.max_wait > 0, f"--max-wait must be > 0 seconds (got {self.max_wait})")
        need(self.max_failures == 0 or self.checkpoint_every > 0 or self.resume is not None,
             f"--max-failures {self.max_failures} restarts from the last checkpoint: also set --checkpoint-every N "
             "(without checkpoints a recovery would start the run over)")
        if self.virtual_stages > 1:
            need(self.pp >= 2, f"--virtual-stages {self.virtual_stages} interleaves model chunks over pipeline "
                               "stages: set --pp 2 or more, or drop --virtual-stages")
            need(self.schedule == "1f1b", f"--virtual-stages {self.virtual_stages} runs interleaved 1F1B: use "
                                          f"--schedule 1f1b, not {self.schedule}, or drop --virtual-stages")
            need(self.fs == 1 and self.plan == "none",
                 f"--virtual-stages {self.virtual_stages} does not combine with --fs or --plan: drop one of them")
            need(self.num_microbatches % self.pp == 0,
                 f"--virtual-stages {self.virtual_stages} takes micro-batches in groups of --pp {self.pp}: set "
                 f"--num-microbatches to a multiple of {self.pp} (got {self.num_microbatches})")
        if self.plan != "none":
            need(self.pp == 1 and self.fs == 1,
                 f"--plan {self.plan} spreads the model over all actors itself: drop --pp/--fs and set only --dp")
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

"""The run configuration: one flat dataclass, its validation and its command-line form.

Every field is a flag of ``python -m rayconv.run`` (``global_batch_size`` is ``--global-batch-size``)
and a key of a JSON config file (``--config FILE``; flags given on the command line win). The resolved
configuration is written to ``<out>/config.json`` and can be passed back with ``--config``.

Errors a user can cause raise :class:`ConfigError` (a ``ValueError``) whose message names the flag
and what to change. A Config is frozen: ``validate()`` checks it and returns it; what the driver
resolves later (the device, ``dp``, the pipeline cut, the output folder) makes a new one with
``dataclasses.replace``. The module imports only ``errors`` and ``choices`` (the flags' named
choices), so that every layer can read settings;
the flags are built from the fields by ``rayconv.flags``, and ``--resume``'s checkpoint is read by the
command line (``rayconv.run``).

The recipe flags keep the names of torchvision's reference script (references/classification/train.py:
``--opt``, ``--lr-warmup-*``, ``--label-smoothing``, ``--norm-weight-decay``, ``--model-ema*``,
``--mixup-alpha``, ``--cutmix-alpha``, ``--random-erase``, ``--clip-grad-norm``); their defaults leave
a run as plain SGD with momentum, cosine decay and no warm-up.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rayconv.choices import (  # noqa: F401 (re-exported: the flags and checks read them here)
    MODELS_HELP, DATA_CHOICES, DECODE_CHOICES, DEVICE_CHOICES, SCHEDULE_CHOICES, PLAN_CHOICES,
    PRECISION_CHOICES, LR_SCHEDULE_CHOICES, COMPILE_CHOICES, BALANCE_CHOICES, LAYOUT_CHOICES,
    OPT_CHOICES, WARMUP_CHOICES, LR_SCALING_CHOICES, AUGMENT_CHOICES, AUTO_AUGMENT_CHOICES,
    SHUFFLE_CHOICES, DATA_ON_DEVICE_CHOICES, DATA_ON_DEVICE_HELP, DATA_IMAGE_SIZE, PAD_CROP_MAX_SIZE, LARS_ETA)
from rayconv.errors import ConfigError


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
    init: Optional[str] = field(default=None, metadata={
        "help": "start from these weights: a run's model.pt (or its folder) or a torchvision-format state_dict, "
                "checked against the model before Ray starts; readable on every node (default: none)"})
    init_skip_head: bool = field(default=False, metadata={
        "help": "with --init: leave the classifier (the model's last Linear) as built, for a new number of classes"})
    evaluate_only: bool = field(default=False, metadata={
        "help": "evaluate --init's weights on the test data (top-1, top-5) and write summary.json; no training"})
    data: str = field(default="digits", metadata={"help": "digits (embedded real scans), fashion-mnist (apt-get install dataset-fashion-mnist, or its idx files in --data-dir), synthetic, imagefolder, "
                                                          "shards (a folder from python -m rayconv.prepare)",
                                                  "choices": DATA_CHOICES})
    data_dir: Optional[str] = field(default=None, metadata={"help": "ImageNet-layout folder (train/, val/), a "
                                    "prepared shard folder or Fashion-MNIST's idx files (without --data: what it holds)"})
    decode: str = field(default="auto", metadata={
        "help": "where --data shards decodes JPEGs: gpu (batched nvJPEG, crop and flip on the actor's GPU), "
                "cpu (--loader-workers processes, libjpeg-turbo), auto: cpu (measured faster on an H200 with "
                "14 workers: nvJPEG and the crops take GPU time from the model)",
        "choices": DECODE_CHOICES})
    num_classes: Optional[int] = field(default=None, metadata={"help": "classes; default: follows the data"})
    image_size: Optional[int] = field(default=None, metadata={
        "help": "side in pixels of the training images (synthetic data, the crops of imagefolder and shards "
                "data, a resize of digits and fashion-mnist); default: the data's own, digits 8, "
                "fashion-mnist 28, synthetic/imagefolder/shards 224 (each model refuses sizes it cannot take)"})
    channels: Optional[int] = field(default=None, metadata={
        "help": "image channels the model takes, 1 or 3 (grey images repeated to 3); default: the data's"})
    augment: str = field(default="auto", metadata={
        "help": "training augmentation: pad-crop (pad by size/8, random crop, horizontal flip), resized-crop "
                "(RandomResizedCrop + flip, Szegedy et al. 2015), none; auto: pad-crop + flip up to 64 pixels, "
                "resized-crop above", "choices": AUGMENT_CHOICES})
    auto_augment: Optional[str] = field(default=None, metadata={
        "help": "augmentation policy after the crop and flip, torchvision's: imagenet, cifar10, svhn "
                "(AutoAugment, Cubuk et al. 2019), ra (RandAugment), ta_wide (TrivialAugmentWide); default none",
        "choices": AUTO_AUGMENT_CHOICES})
    random_erase: float = field(default=0.0, metadata={
        "help": "probability in [0, 1] of erasing a random rectangle of each training image (Zhong et al. "
                "2020, torchvision's --random-erase; default 0)"})
    zero_init_residual: bool = field(default=False, metadata={
        "help": "start the last batch norm of each residual block at zero weight, so each block starts as "
                "the identity (Goyal et al. 2017, section 5.1; torchvision's zero_init_residual)"})
    data_on_device: str = field(default="auto", metadata={"help": DATA_ON_DEVICE_HELP, "choices": DATA_ON_DEVICE_CHOICES})
    synthetic_samples: int = field(default=4096, metadata={"help": "train samples of synthetic data"})
    shuffle: str = field(default="exact", metadata={"choices": SHUFFLE_CHOICES, "help": "train order: exact "
        "(all samples permuted per epoch) or block (--data shards: shards permuted, then the samples of each "
        "window of --shuffle-window shards; README: Shuffle order)"})
    shuffle_window: int = field(default=8, metadata={"help": "--shuffle block: shards per window, >= 1"})
    stage_dir: Optional[str] = field(default=None, metadata={"help": "--data shards: first copy the shards to "
        "this folder on each node's local disk (sha256-checked, skipped when there) and read them there"})
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
    lr: float = field(default=0.05, metadata={
        "help": "peak learning rate: for the global batch with --lr-scaling none (default 0.05); per 256 images "
                "with --lr-scaling linear, multiplied by global batch / 256"})
    lr_scaling: str = field(default="none", metadata={
        "help": "none: --lr is for the global batch; linear: --lr is per 256 images and multiplied by global "
                "batch / 256 (Goyal et al. 2017, section 2.1)", "choices": LR_SCALING_CHOICES})
    lr_warmup_epochs: int = field(default=0, metadata={
        "help": "epochs of learning-rate warm-up, counted in steps (epochs x steps per epoch), the cosine "
                "decay after it (Goyal et al. 2017, section 2.2; default 0: none)"})
    lr_warmup_method: str = field(default="linear", metadata={
        "help": "warm-up: linear (from --lr x --lr-warmup-decay up to --lr, torch's LinearLR) or constant "
                "(--lr x --lr-warmup-decay throughout, ConstantLR)", "choices": WARMUP_CHOICES})
    lr_warmup_decay: float = field(default=0.01, metadata={
        "help": "the warm-up's starting fraction of --lr, in (0, 1] (default 0.01; torchvision's recipe 0.01)"})
    opt: str = field(default="sgd", metadata={
        "help": "optimizer: sgd (with --momentum), sgd_nesterov (Nesterov momentum, Sutskever et al. 2013), "
                "lars (layer-wise trust ratios, You et al. 2017; norm layers and biases plain SGD), adamw "
                "(Loshchilov & Hutter 2019)", "choices": OPT_CHOICES})
    lars_trust_coefficient: float = field(default=LARS_ETA, metadata={
        "help": "--opt lars: the trust coefficient eta of each layer's ratio eta ||w|| / (||g|| + wd ||w||)"})
    lr_schedule: str = field(default="cosine", metadata={"help": "learning-rate schedule", "choices": LR_SCHEDULE_CHOICES})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=5e-4, metadata={"help": "L2 weight decay"})
    norm_weight_decay: Optional[float] = field(default=None, metadata={
        "help": "weight decay of normalisation layers' weights and biases, e.g. 0 (torchvision's "
                "--norm-weight-decay); default: --weight-decay"})
    bias_weight_decay: Optional[float] = field(default=None, metadata={
        "help": "weight decay of every bias (torchvision's --bias-weight-decay); default: --weight-decay"})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "label smoothing in [0, 1) of the cross entropy (Szegedy et al. 2016, section 7; default 0)"})
    clip_grad_norm: Optional[float] = field(default=None, metadata={
        "help": "clip the global gradient norm over all shards to this (> 0, Pascanu et al. 2013); default: none"})
    mixup_alpha: float = field(default=0.0, metadata={
        "help": "mixup's Beta(alpha, alpha), >= 0, drawn per global batch (Zhang et al. 2018; default 0: off)"})
    cutmix_alpha: float = field(default=0.0, metadata={
        "help": "CutMix's Beta(alpha, alpha), >= 0, drawn per global batch (Yun et al. 2019; default 0: off); "
                "with mixup too, one of the two per batch"})
    model_ema: bool = field(default=False, metadata={
        "help": "keep an exponential moving average of the weights, evaluate it after each evaluation and "
                "write model_ema.pt (torchvision's --model-ema; default off)"})
    model_ema_steps: int = field(default=32, metadata={"help": "steps between EMA updates, >= 1 (default 32)"})
    model_ema_decay: float = field(default=0.99998, metadata={
        "help": "EMA decay in [0, 1], adjusted for the batch and --model-ema-steps as torchvision's train.py "
                "does (default 0.99998, torchvision's)"})
    seed: int = field(default=0, metadata={"help": "seed of weights, data order and augmentation"})
    precision: str = field(default="fp32", metadata={
        "help": "fp32, bf16 (autocast), fp16 (autocast with dynamic loss scaling, Micikevicius et al. 2018) or "
                "fp64", "choices": PRECISION_CHOICES})
    compile: str = field(default="auto", metadata={
        "help": "torch.compile each actor's part, in segments that end at the gradient bucket size: on, off, or "
                "auto: on with GPUs (except fp64; with --cuda-graphs off, one-GPU runs only), where it was measured "
                "to pay; compile time is spent in the first step", "choices": COMPILE_CHOICES})
    cuda_graphs: str = field(default="auto", metadata={
        "help": "capture each actor's whole training step (forward, backward, exchanges, all-reduce, update) as "
                "one CUDA graph and replay it, so the CPU launches one graph a step, not every kernel: on, off, "
                "or auto: on with GPUs; refused on CPU", "choices": COMPILE_CHOICES})
    cudnn_benchmark: str = field(default="auto", metadata={
        "help": "let cuDNN time its algorithms for each new convolution shape (torch.backends.cudnn.benchmark): "
                "on, off, or auto: on for runs of at least 10,000 steps, where its faster steps repay the seconds "
                "of timing at the first step, the last partial batch and the first evaluation", "choices": COMPILE_CHOICES})
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
    target_accuracy: Optional[float] = field(default=None, metadata={
        "help": "record the first evaluation whose test top-1 accuracy reaches this, in (0, 1]: summary.json's "
                "time_to_target_s (wall-clock from the start) and time_to_target_train_s (the steps' time); "
                "training goes on (default: none)"})
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
        _check_recipe(self)
        _check_combinations(self)
        return self

    @property
    def world_size(self) -> int:
        """Actors in the mesh: dp * pp * fs (dp must be resolved)."""
        assert self.dp is not None, "dp is resolved against the cluster first"
        return self.dp * self.pp * self.fs

    @property
    def data_image_size(self) -> int:
        """Side in pixels of the training images: ``image_size``, else the data's own (``DATA_IMAGE_SIZE``)."""
        return self.image_size if self.image_size is not None else DATA_IMAGE_SIZE.get(self.data, 224)

    @property
    def augmentation(self) -> str:
        """The augmentation ``augment`` names, ``auto`` resolved by the image side: ``pad-crop`` up to
        ``PAD_CROP_MAX_SIZE`` pixels (small images, as CIFAR's recipe), ``resized-crop`` above (ImageNet's)."""
        if self.augment != "auto":
            return self.augment
        return "pad-crop" if self.data_image_size <= PAD_CROP_MAX_SIZE else "resized-crop"

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
    _need(cfg.precision in PRECISION_CHOICES, f"unknown --precision {cfg.precision!r}: choose fp32, bf16, fp16 or fp64")
    _need(cfg.layout in LAYOUT_CHOICES, f"unknown --layout {cfg.layout!r}: choose manual or auto")
    _need(cfg.balance in BALANCE_CHOICES, f"unknown --balance {cfg.balance!r}: choose auto, time or flops")
    _need(cfg.compile in COMPILE_CHOICES, f"unknown --compile {cfg.compile!r}: choose auto, on or off")
    _need(cfg.cudnn_benchmark in COMPILE_CHOICES, f"unknown --cudnn-benchmark {cfg.cudnn_benchmark!r}: choose auto, on or off")
    _need(cfg.cuda_graphs in COMPILE_CHOICES, f"unknown --cuda-graphs {cfg.cuda_graphs!r}: choose auto, on or off")
    _need(not (cfg.cuda_graphs == "on" and cfg.device == "cpu"),
          "--cuda-graphs on needs GPUs (CUDA graphs): drop it on CPU (--device cpu, or a cluster without GPUs)")
    _need(not (cfg.cuda_graphs == "on" and (cfg.opt == "adamw" or cfg.precision == "fp16")),
          f"--cuda-graphs on captures SGD steps only (an fp16 step may be skipped, which the host decides): "
          f"drop it with {'--opt adamw' if cfg.opt == 'adamw' else '--precision fp16'} (auto steps eagerly)")
    _need(not (cfg.sync_batchnorm and cfg.device == "cpu"),
          "--sync-batchnorm needs GPUs (torch's SyncBatchNorm is CUDA only): drop it with --device cpu (statistics per replica)")
    _need(cfg.lr_schedule in LR_SCHEDULE_CHOICES, f"unknown --lr-schedule {cfg.lr_schedule!r}: constant or cosine")
    _need(cfg.data != "imagefolder" or bool(cfg.data_dir),
          "--data imagefolder needs --data-dir DIR (a folder with train/<class>/<images> and val/<class>/<images>)")
    _need(cfg.data != "shards" or bool(cfg.data_dir),
          "--data shards needs --data-dir SHARDS (a folder written by python -m rayconv.prepare DIR --out SHARDS)")
    _need(cfg.shuffle in SHUFFLE_CHOICES, f"unknown --shuffle {cfg.shuffle!r}: choose exact or block")
    _need(cfg.shuffle != "block" or cfg.data == "shards",
          f"--shuffle block permutes windows of shards: use --data shards (got --data {cfg.data}) or --shuffle exact")
    _need(cfg.stage_dir is None or cfg.data == "shards",
          f"--stage-dir copies a prepared shard folder: use --data shards (got --data {cfg.data}), or drop it")
    _need(cfg.opt in OPT_CHOICES, f"unknown --opt {cfg.opt!r}: choose one of {', '.join(OPT_CHOICES)}")
    _need(cfg.lr_warmup_method in WARMUP_CHOICES, f"unknown --lr-warmup-method {cfg.lr_warmup_method!r}: linear, constant")
    _need(cfg.lr_scaling in LR_SCALING_CHOICES, f"unknown --lr-scaling {cfg.lr_scaling!r}: choose none or linear")
    _need(cfg.augment in AUGMENT_CHOICES, f"unknown --augment {cfg.augment!r}: choose one of {', '.join(AUGMENT_CHOICES)}")
    _need(cfg.auto_augment is None or cfg.auto_augment in AUTO_AUGMENT_CHOICES,
          f"unknown --auto-augment {cfg.auto_augment!r}: choose one of {', '.join(AUTO_AUGMENT_CHOICES)}")
    _need(cfg.auto_augment is None or cfg.data in ("fashion-mnist", "imagefolder", "shards"),
          f"--auto-augment augments fashion-mnist, imagefolder and shards data, not --data {cfg.data}: drop it")
    _need(cfg.decode in DECODE_CHOICES, f"unknown --decode {cfg.decode!r}: choose auto, cpu or gpu")
    _need(not (cfg.decode == "gpu" and cfg.device == "cpu"),
          "--decode gpu decodes on the actors' GPUs: use --decode cpu with --device cpu")


def _check_numbers(cfg: Config) -> None:
    """Counts at least 1 (0 where it means none), rates, sizes and times positive, the batch split
    evenly (when --dp is given)."""
    for name in ("pp", "fs", "num_microbatches", "virtual_stages", "global_batch_size", "log_every",
                 "num_cpus_per_actor", "exchange_chunks", "shuffle_window"):
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
    _need(cfg.image_size is None or cfg.image_size >= 1, f"--image-size must be >= 1 pixel (got {cfg.image_size})")
    _need(cfg.loader_workers is None or cfg.loader_workers >= 0, "--loader-workers must be >= 0")
    _need(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 steps (got {cfg.checkpoint_every}; "
                                      "0 writes no checkpoints)")
    _need(cfg.keep_checkpoints >= 0, f"--keep-checkpoints must be >= 0 (got {cfg.keep_checkpoints}; 0 keeps all)")
    _need(cfg.max_failures >= 0, f"--max-failures must be >= 0 (got {cfg.max_failures})")
    _need(cfg.max_wait > 0, f"--max-wait must be > 0 seconds (got {cfg.max_wait})")
    _need(cfg.max_memory_gib is None or cfg.max_memory_gib > 0,
          f"--max-memory-gib must be > 0 GiB (got {cfg.max_memory_gib})")


def _check_recipe(cfg: Config) -> None:
    """The training recipe's numbers in their ranges (torchvision's reference script takes the same)."""
    _need(cfg.lr_warmup_epochs >= 0, f"--lr-warmup-epochs must be >= 0 (got {cfg.lr_warmup_epochs}; 0: no warm-up)")
    _need(0 < cfg.lr_warmup_decay <= 1, f"--lr-warmup-decay must be in (0, 1] (got {cfg.lr_warmup_decay})")
    _need(cfg.lars_trust_coefficient > 0, f"--lars-trust-coefficient must be > 0 (got {cfg.lars_trust_coefficient})")
    _need(cfg.opt == "lars" or cfg.lars_trust_coefficient == LARS_ETA, "--lars-trust-coefficient is --opt lars's: add that or drop it")
    _need(0 <= cfg.label_smoothing < 1, f"--label-smoothing must be in [0, 1) (got {cfg.label_smoothing})")
    for name in ("norm_weight_decay", "bias_weight_decay"):
        v = getattr(cfg, name)
        _need(v is None or v >= 0, f"--{name.replace('_', '-')} must be >= 0 (got {v}; leave it out for --weight-decay)")
    _need(cfg.clip_grad_norm is None or cfg.clip_grad_norm > 0,
          f"--clip-grad-norm must be > 0 (got {cfg.clip_grad_norm}; leave it out for no clipping)")
    _need(cfg.model_ema_steps >= 1, f"--model-ema-steps must be >= 1 (got {cfg.model_ema_steps})")
    _need(0 <= cfg.model_ema_decay <= 1, f"--model-ema-decay must be in [0, 1] (got {cfg.model_ema_decay})")
    _need(cfg.mixup_alpha >= 0, f"--mixup-alpha must be >= 0 (got {cfg.mixup_alpha}; 0: off)")
    _need(cfg.cutmix_alpha >= 0, f"--cutmix-alpha must be >= 0 (got {cfg.cutmix_alpha}; 0: off)")
    _need(0 <= cfg.random_erase <= 1, f"--random-erase must be a probability in [0, 1] (got {cfg.random_erase})")
    _need(cfg.channels in (None, 1, 3), f"--channels must be 1 or 3 (got {cfg.channels}; leave it out for the data's)")
    _need(cfg.target_accuracy is None or 0 < cfg.target_accuracy <= 1,
          f"--target-accuracy must be in (0, 1] (got {cfg.target_accuracy})")


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
    _need(cfg.init is not None or not (cfg.init_skip_head or cfg.evaluate_only),
          f"--{'init-skip-head' if cfg.init_skip_head else 'evaluate-only'} applies to the weights of --init PATH: "
          "add it, or drop the flag")
    _need(not (cfg.init and cfg.resume), "--init starts a new run from given weights, --resume continues one "
                                         "from its checkpoint: give one of them")
    _need(not (cfg.evaluate_only and cfg.init_skip_head), "--evaluate-only with --init-skip-head would evaluate "
                                                          "a classifier never trained: drop --init-skip-head")
    if cfg.plan != "none":
        _need(cfg.pp == 1 and cfg.fs == 1,
              f"--plan {cfg.plan} spreads the model over all actors itself: drop --pp/--fs and set only --dp")

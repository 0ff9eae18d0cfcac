"""The checks of a :class:`rayconv.config.Config` that need no cluster and no data.

``check(cfg)`` (what ``Config.validate`` runs) raises :class:`ConfigError` with a one-line message
that names the flag and what to change: choices among the known ones, numbers in their ranges, the
recipe's numbers as torchvision's reference script takes them, and settings that only make sense
together. ``batch_split_problem`` is also asked once ``dp`` is known from the cluster. The module
imports only ``errors`` and ``choices`` (``rayconv.config`` imports it, so it does not import that
back: ``cfg`` is a Config by duck typing).
"""

from __future__ import annotations

from typing import Any, Optional

from rayconv.choices import (
    DATA_CHOICES, DECODE_CHOICES, DEVICE_CHOICES, SCHEDULE_CHOICES, PLAN_CHOICES, PRECISION_CHOICES,
    LR_SCHEDULE_CHOICES, COMPILE_CHOICES, BALANCE_CHOICES, LAYOUT_CHOICES, OPT_CHOICES, WARMUP_CHOICES,
    LR_SCALING_CHOICES, AUGMENT_CHOICES, AUTO_AUGMENT_CHOICES, SHUFFLE_CHOICES, LARS_ETA, AUGMENTED_DATA,
    FIXED_SIZE_DATA, DATA_IMAGE_SIZE)
from rayconv.errors import ConfigError

SEED_LIMIT = 2**64   # --seed below it: torch.manual_seed takes [0, 2**64), numpy non-negative seeds


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



def check(cfg: Any) -> None:
    """Check a Config (``cfg``) as far as it can be checked without a cluster or data. Raises
    ConfigError naming the flag and what to change."""
    _check_names(cfg)
    _check_numbers(cfg)
    _check_recipe(cfg)
    _check_combinations(cfg)


def _listed(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_names(cfg: Any) -> None:
    """Every choice among the known ones, and the choices that need GPUs or a data folder."""
    _need(cfg.data in DATA_CHOICES, f"unknown --data {cfg.data!r}: choose one of {', '.join(DATA_CHOICES)}")
    _need(cfg.device in DEVICE_CHOICES, f"unknown --device {cfg.device!r}: choose auto, cpu or cuda")
    _need(cfg.schedule in SCHEDULE_CHOICES, f"unknown --schedule {cfg.schedule!r}: choose gpipe or 1f1b")
    _need(cfg.plan in PLAN_CHOICES, f"unknown --plan {cfg.plan!r}: choose one of {', '.join(PLAN_CHOICES)}")
    _need(cfg.precision in PRECISION_CHOICES,
          f"unknown --precision {cfg.precision!r}: choose fp32, bf16, fp16 or fp64")
    _need(cfg.layout in LAYOUT_CHOICES, f"unknown --layout {cfg.layout!r}: choose manual or auto")
    _need(cfg.balance in BALANCE_CHOICES, f"unknown --balance {cfg.balance!r}: choose auto, time or flops")
    _need(cfg.compile in COMPILE_CHOICES, f"unknown --compile {cfg.compile!r}: choose auto, on or off")
    _need(cfg.cudnn_benchmark in COMPILE_CHOICES,
          f"unknown --cudnn-benchmark {cfg.cudnn_benchmark!r}: choose auto, on or off")
    _need(cfg.cuda_graphs in COMPILE_CHOICES,
          f"unknown --cuda-graphs {cfg.cuda_graphs!r}: choose auto, on or off")
    _need(not (cfg.cuda_graphs == "on" and cfg.device == "cpu"),
          "--cuda-graphs on needs GPUs (CUDA graphs): drop it on CPU (--device cpu, or a cluster without "
          "GPUs)")
    _need(not (cfg.cuda_graphs == "on" and (cfg.opt == "adamw" or cfg.precision == "fp16")),
          f"--cuda-graphs on captures SGD steps only (an fp16 step may be skipped, which the host decides): "
          f"drop it with {'--opt adamw' if cfg.opt == 'adamw' else '--precision fp16'} (auto steps eagerly)")
    _need(not (cfg.sync_batchnorm and cfg.device == "cpu"),
          "--sync-batchnorm needs GPUs (torch's SyncBatchNorm is CUDA only): drop it with --device cpu "
          "(statistics per replica)")
    _need(cfg.lr_schedule in LR_SCHEDULE_CHOICES,
          f"unknown --lr-schedule {cfg.lr_schedule!r}: constant or cosine")
    _need(cfg.data != "imagefolder" or bool(cfg.data_dir),
          "--data imagefolder needs --data-dir DIR (a folder with train/<class>/<images> and "
          "val/<class>/<images>)")
    _need(cfg.data != "shards" or bool(cfg.data_dir),
          "--data shards needs --data-dir SHARDS (a folder written by python -m rayconv.prepare DIR --out "
          "SHARDS)")
    _need(not (cfg.data_on_device == "on" and cfg.augmentation == "resized-crop"),
          "--data-on-device on holds each image's center crop, but --augment resized-crop needs each image's "
          "own size: use --augment pad-crop or none, or --data-on-device auto or off")
    _need(cfg.shuffle in SHUFFLE_CHOICES, f"unknown --shuffle {cfg.shuffle!r}: choose exact or block")
    _need(cfg.shuffle != "block" or cfg.data == "shards",
          f"--shuffle block permutes windows of shards: use --data shards (got --data {cfg.data}) or "
          "--shuffle exact")
    _need(
        cfg.stage_dir is None or cfg.data == "shards",
        f"--stage-dir copies a prepared shard folder: use --data shards (got --data {cfg.data}), or drop it")
    _need(cfg.cache_bytes is None or cfg.cache_bytes > 0,
          f"--cache-bytes {cfg.cache_bytes}: give a positive byte count")
    _need(cfg.opt in OPT_CHOICES, f"unknown --opt {cfg.opt!r}: choose one of {', '.join(OPT_CHOICES)}")
    _need(cfg.lr_warmup_method in WARMUP_CHOICES,
          f"unknown --lr-warmup-method {cfg.lr_warmup_method!r}: linear, constant")
    _need(cfg.lr_scaling in LR_SCALING_CHOICES,
          f"unknown --lr-scaling {cfg.lr_scaling!r}: choose none or linear")
    _need(cfg.augment in AUGMENT_CHOICES,
          f"unknown --augment {cfg.augment!r}: choose one of {', '.join(AUGMENT_CHOICES)}")
    _need(cfg.auto_augment is None or cfg.auto_augment in AUTO_AUGMENT_CHOICES,
          f"unknown --auto-augment {cfg.auto_augment!r}: choose one of {', '.join(AUTO_AUGMENT_CHOICES)}")
    _need(cfg.auto_augment is None or cfg.data in AUGMENTED_DATA,
          f"--auto-augment augments fashion-mnist, imagefolder and shards data, not --data {cfg.data}: drop "
          "it")
    side = DATA_IMAGE_SIZE.get(cfg.data)
    _need(cfg.data not in FIXED_SIZE_DATA or cfg.image_size in (None, side),
          f"--data {cfg.data} holds {side}x{side} images, never resized: drop --image-size {cfg.image_size}, "
          "or use data it sizes (--data fashion-mnist, synthetic, imagefolder or shards)")
    _need(cfg.augment in ("auto", "none") or cfg.data in AUGMENTED_DATA,
          f"--augment {cfg.augment} augments {_listed(AUGMENTED_DATA)} data, not --data {cfg.data}: drop it")
    _need(cfg.random_erase == 0 or cfg.data in AUGMENTED_DATA,
          f"--random-erase erases in {_listed(AUGMENTED_DATA)} data, not --data {cfg.data}: drop it")
    _need(cfg.decode in DECODE_CHOICES, f"unknown --decode {cfg.decode!r}: choose auto, cpu or gpu")
    _need(not (cfg.decode == "gpu" and cfg.device == "cpu"),
          "--decode gpu decodes on the actors' GPUs: use --decode cpu with --device cpu")


def _check_numbers(cfg: Any) -> None:
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
    _need(0 <= cfg.seed < SEED_LIMIT, f"--seed must be in [0, 2**64) (got {cfg.seed}): torch and numpy take "
                                        "non-negative seeds")
    _need(cfg.synthetic_samples >= 1, f"--synthetic-samples must be >= 1 (got {cfg.synthetic_samples})")
    _need(cfg.lr > 0, f"--lr must be > 0 (got {cfg.lr})")
    _need(0 <= cfg.momentum < 1, f"--momentum must be in [0, 1) (got {cfg.momentum})")
    _need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0 (got {cfg.weight_decay})")
    _need(cfg.bucket_mb > 0, f"--bucket-mb must be > 0 (got {cfg.bucket_mb})")
    _need(cfg.collective_timeout_s > 0, "--collective-timeout-s must be > 0")
    _need(cfg.image_size is None or cfg.image_size >= 1,
          f"--image-size must be >= 1 pixel (got {cfg.image_size})")
    _need(cfg.loader_workers is None or cfg.loader_workers >= 0, "--loader-workers must be >= 0")
    _need(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 steps (got {cfg.checkpoint_every}; "
                                      "0 writes no checkpoints)")
    _need(cfg.keep_checkpoints >= 0,
          f"--keep-checkpoints must be >= 0 (got {cfg.keep_checkpoints}; 0 keeps all)")
    _need(cfg.max_failures is None or cfg.max_failures >= -1,
          f"--max-failures must be >= 0, or -1 for no limit (got {cfg.max_failures})")
    _need(cfg.max_wait > 0, f"--max-wait must be > 0 seconds (got {cfg.max_wait})")
    _need(0 < cfg.gpus_per_actor <= 1, f"--gpus-per-actor must be a share of one GPU in (0, 1], e.g. 0.25 "
                                        f"(got {cfg.gpus_per_actor})")
    _need(cfg.gpus_per_actor == 1 or cfg.device != "cpu",
          "--gpus-per-actor shares GPUs: drop it with --device cpu (CPU actors take --num-cpus-per-actor)")
    _need(cfg.elastic is None or cfg.elastic >= 1, f"--elastic must be >= 1 actor (got {cfg.elastic})")
    _need(cfg.elastic_wait >= 0, f"--elastic-wait must be >= 0 seconds (got {cfg.elastic_wait})")
    _need(cfg.max_memory_gib is None or cfg.max_memory_gib > 0,
          f"--max-memory-gib must be > 0 GiB (got {cfg.max_memory_gib})")


def _check_recipe(cfg: Any) -> None:
    """The training recipe's numbers in their ranges (torchvision's reference script takes the same)."""
    _need(cfg.keep_actors_s >= 0,
          f"--keep-actors-s must be >= 0 (got {cfg.keep_actors_s:g}; 0: the actors stop at the run's end)")
    _need(cfg.lr_warmup_epochs >= 0,
          f"--lr-warmup-epochs must be >= 0 (got {cfg.lr_warmup_epochs}; 0: no warm-up)")
    _need(0 < cfg.lr_warmup_decay <= 1, f"--lr-warmup-decay must be in (0, 1] (got {cfg.lr_warmup_decay})")
    _need(cfg.lars_trust_coefficient > 0,
          f"--lars-trust-coefficient must be > 0 (got {cfg.lars_trust_coefficient})")
    _need(cfg.opt == "lars" or cfg.lars_trust_coefficient == LARS_ETA,
          "--lars-trust-coefficient is --opt lars's: add that or drop it")
    _need(0 <= cfg.label_smoothing < 1, f"--label-smoothing must be in [0, 1) (got {cfg.label_smoothing})")
    for name in ("norm_weight_decay", "bias_weight_decay"):
        v = getattr(cfg, name)
        _need(v is None or v >= 0,
              f"--{name.replace('_', '-')} must be >= 0 (got {v}; leave it out for --weight-decay)")
    _need(cfg.clip_grad_norm is None or cfg.clip_grad_norm > 0,
          f"--clip-grad-norm must be > 0 (got {cfg.clip_grad_norm}; leave it out for no clipping)")
    _need(cfg.model_ema_steps >= 1, f"--model-ema-steps must be >= 1 (got {cfg.model_ema_steps})")
    _need(0 <= cfg.model_ema_decay <= 1, f"--model-ema-decay must be in [0, 1] (got {cfg.model_ema_decay})")
    _need(cfg.bn_momentum is None or 0 < cfg.bn_momentum <= 1,
          f"--bn-momentum must be in (0, 1] (got {cfg.bn_momentum}; leave it out for the model's own)")
    _need(cfg.precise_bn_batches >= 0,
          f"--precise-bn-batches must be >= 0 (got {cfg.precise_bn_batches}; 0: off)")
    _need(cfg.mixup_alpha >= 0, f"--mixup-alpha must be >= 0 (got {cfg.mixup_alpha}; 0: off)")
    _need(cfg.cutmix_alpha >= 0, f"--cutmix-alpha must be >= 0 (got {cfg.cutmix_alpha}; 0: off)")
    _need(0 <= cfg.random_erase <= 1,
          f"--random-erase must be a probability in [0, 1] (got {cfg.random_erase})")
    _need(cfg.channels in (None, 1, 3),
          f"--channels must be 1 or 3 (got {cfg.channels}; leave it out for the data's)")
    _need(cfg.target_accuracy is None or 0 < cfg.target_accuracy <= 1,
          f"--target-accuracy must be in (0, 1] (got {cfg.target_accuracy})")
    _need(0 <= cfg.val_split < 1, f"--val-split must be a fraction in [0, 1) (got {cfg.val_split}; 0: none)")
    for name in ("eval_test", "keep_best"):
        _need(cfg.val_split > 0 or not getattr(cfg, name),
              f"--{name.replace('_', '-')} applies to a run with a validation split: add --val-split F, or "
              "drop it")
    _need(cfg.tensorboard in ("on", "off"), f"unknown --tensorboard {cfg.tensorboard!r}: choose on or off")
    _need(cfg.log_images >= 0, f"--log-images must be >= 0 (got {cfg.log_images}; 0: none)")
    _need(
        cfg.log_images == 0 or cfg.tensorboard == "on",
        "--log-images puts its grid in the TensorBoard event files: drop --tensorboard off, or --log-images")


def _check_combinations(cfg: Any) -> None:
    """Settings that only make sense together (exchange chunks with filter split, recovery with
    checkpoints, virtual stages with an interleavable pipeline, the per-layer plan alone)."""
    _need(cfg.exchange_chunks == 1 or cfg.fs > 1 or cfg.layout == "auto",
          f"--exchange-chunks {cfg.exchange_chunks} applies to filter split's gathers: add --fs 2 (or more), "
          "or drop it")
    _need(not cfg.max_failures or cfg.checkpoint_every > 0 or cfg.resume is not None,
          f"--max-failures {cfg.max_failures} restarts from the last checkpoint: also set --checkpoint-every "
          "N (without checkpoints a recovery would start the run over)")
    if cfg.elastic is not None:
        _need(cfg.checkpoint_every > 0,
              f"--elastic {cfg.elastic} continues from the last checkpoint on another "
              "layout: also set --checkpoint-every N")
        size = cfg.dp * cfg.pp * cfg.fs if cfg.dp else None
        _need(size is None or cfg.elastic <= size,
              f"--elastic {cfg.elastic} is above the layout's {size} actors: "
              f"give --elastic {size} or less")
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
          f"--{'init-skip-head' if cfg.init_skip_head else 'evaluate-only'} applies to the weights of --init "
          "PATH: add it, or drop the flag")
    _need(not (cfg.init and cfg.resume), "--init starts a new run from given weights, --resume continues one "
                                         "from its checkpoint: give one of them")
    _need(not (cfg.evaluate_only and cfg.init_skip_head),
          "--evaluate-only with --init-skip-head would evaluate "
          "a classifier never trained: drop --init-skip-head")
    if cfg.plan != "none":
        _need(cfg.pp == 1 and cfg.fs == 1,
              f"--plan {cfg.plan} spreads the model over all actors itself: drop --pp/--fs and set only --dp")

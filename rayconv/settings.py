"""The run configuration's fields, declared in sections by concern: ``ModelSettings``,
``DataSettings``, ``LayoutFields`` and ``LayoutSettings``, ``RecipeSettings``, ``ExecutionSettings``,
``ClusterSettings``, ``OutputSettings``, ``OperationsSettings``. ``rayconv.config.Config`` inherits them
all, so a setting is read flat (``cfg.lr``) and its name is its flag's; a function may annotate the
section it reads. ``LayoutFields`` are also the fields of ``rayconv.layout.Layout``.

Each field's ``metadata`` holds its flag's ``help`` and, where the flag takes named values, its
``choices`` (from ``rayconv.choices``); ``rayconv.flags`` builds the flags from them. The module imports
only ``choices``, so that every layer can read the sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rayconv.choices import (
    MODELS_HELP, DATA_CHOICES, DECODE_CHOICES, DEVICE_CHOICES, SCHEDULE_CHOICES, PLAN_CHOICES,
    PRECISION_CHOICES, LR_SCHEDULE_CHOICES, COMPILE_CHOICES, BALANCE_CHOICES, LAYOUT_CHOICES, OPT_CHOICES,
    WARMUP_CHOICES, LR_SCALING_CHOICES, AUGMENT_CHOICES, AUTO_AUGMENT_CHOICES, SHUFFLE_CHOICES,
    DATA_ON_DEVICE_CHOICES, DATA_ON_DEVICE_HELP, LARS_ETA, CUDNN_BENCHMARK_MIN_STEPS)


@dataclass(frozen=True)
class ModelSettings:
    """What to train: the model, its starting weights and classes."""

    model: str = field(default="convnet", metadata={"help": MODELS_HELP})
    init: Optional[str] = field(default=None, metadata={
        "help": "start from these weights: a run's model.pt (or its folder) or a torchvision-format "
                "state_dict, checked against the model before Ray starts; readable on every node (default: "
                "none)"})
    init_skip_head: bool = field(default=False, metadata={
        "help": "with --init: leave the classifier (the model's last Linear) as built, for a new number of "
                "classes"})
    evaluate_only: bool = field(default=False, metadata={
        "help": "evaluate --init's weights on the test data (top-1, top-5) and write summary.json; no "
                "training"})
    num_classes: Optional[int] = field(default=None, metadata={"help": "classes; default: follows the data"})
    zero_init_residual: bool = field(default=False, metadata={
        "help": "start the last batch norm of each residual block at zero weight, so each block starts as "
                "the identity (Goyal et al. 2017, section 5.1; torchvision's zero_init_residual)"})


@dataclass(frozen=True)
class DataSettings:
    """The training and test data: source, image form, augmentation, order and loading."""

    data: str = field(default="digits", metadata={
        "help": "digits (embedded real scans), fashion-mnist (apt-get install dataset-fashion-mnist, or its "
                "idx files in --data-dir), synthetic, imagefolder, shards (a folder from python -m "
                "rayconv.prepare)", "choices": DATA_CHOICES})
    data_dir: Optional[str] = field(default=None, metadata={
        "help": "ImageNet-layout folder (train/, val/), a prepared shard folder or Fashion-MNIST's idx files "
                "(without --data: what it holds)"})
    decode: str = field(default="auto", metadata={
        "help": "where --data shards decodes JPEGs: gpu (batched nvJPEG, crop and flip on the actor's GPU), "
                "cpu (--loader-workers processes, libjpeg-turbo), auto: cpu (nvJPEG and the crops take GPU "
                "time from the model; measured: benchmarks/RESULTS.md, Real image files)",
        "choices": DECODE_CHOICES})
    image_size: Optional[int] = field(default=None, metadata={
        "help": "side in pixels of the training images (synthetic data, the crops of imagefolder and shards "
                "data, a resize of fashion-mnist; digits are never resized: refused with them); default: the "
                "data's own, digits 8, fashion-mnist 28, raw-pixel shards their stored side, "
                "synthetic/imagefolder/JPEG shards 224 (each model refuses sizes it cannot take)"})
    channels: Optional[int] = field(default=None, metadata={
        "help": "image channels the model takes, 1 or 3 (grey repeated to 3); default: the model's (a "
                "user's: its first convolution's)"})
    augment: str = field(default="auto", metadata={
        "help": "training augmentation: pad-crop (pad by size/8, random crop, horizontal flip), resized-crop "
                "(RandomResizedCrop + flip, Szegedy et al. 2015), none; auto: pad-crop + flip up to 64 "
                "pixels, resized-crop above; fashion-mnist, imagefolder and shards data (digits and "
                "synthetic are never augmented: pad-crop and resized-crop refused with them)",
        "choices": AUGMENT_CHOICES})
    auto_augment: Optional[str] = field(default=None, metadata={
        "help": "augmentation policy after the crop and flip, torchvision's: imagenet, cifar10, svhn "
                "(AutoAugment, Cubuk et al. 2019), ra (RandAugment), ta_wide (TrivialAugmentWide); default "
                "none", "choices": AUTO_AUGMENT_CHOICES})
    random_erase: float = field(default=0.0, metadata={
        "help": "probability in [0, 1] of erasing a random rectangle of each training image (Zhong et al. "
                "2020, torchvision's --random-erase; default 0; fashion-mnist, imagefolder and shards data)"})
    data_on_device: str = field(default="auto",
                                metadata={"help": DATA_ON_DEVICE_HELP, "choices": DATA_ON_DEVICE_CHOICES})
    synthetic_samples: int = field(default=4096, metadata={"help": "train samples of synthetic data"})
    shuffle: str = field(default="exact", metadata={"choices": SHUFFLE_CHOICES, "help": "train order: exact "
        "(all samples permuted per epoch) or block (--data shards: shards permuted, then the samples of each "
        "window of --shuffle-window shards; docs/data.md: Shuffle order)"})
    shuffle_window: int = field(default=8, metadata={"help": "--shuffle block: shards per window, >= 1"})
    stage_dir: Optional[str] = field(default=None, metadata={
        "help": "--data shards: first copy the shards to this folder on each node's local disk "
                "(sha256-checked, skipped when there) and read them there"})
    cache_bytes: Optional[int] = field(default=None, metadata={"help": "--data-dir in object storage "
        "(s3://, gs://): bytes of shards each node's cache keeps (other sets evicted first; a larger set "
        "streams through it: docs/data.md); default: half the cache disk's free space"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "--data-dir in object storage: each "
        "node's cache folder; default: shards/ in rayconv's cache ($RAYCONV_CACHE_DIR, ~/.cache/rayconv)"})
    loader_workers: Optional[int] = field(default=None, metadata={
        "help": "decode processes per actor for imagefolder data and shards decoded on the CPU; default: on "
                "GPUs the node's CPU cores per GPU less 2 (at least 2), on CPUs 2"})


@dataclass(frozen=True)
class LayoutFields:
    """The layout: a mesh of ``dp * pp * fs`` actors (or the per-layer plan over ``dp``), the pipeline's
    micro-batches, schedule and virtual stages, and filter split's exchange pieces. Defined here once:
    Config's flags and the fields of ``rayconv.layout.Layout`` (which names a layout, with its own
    defaults for ``dp`` and ``num_microbatches``)."""

    dp: Optional[int] = field(default=None, metadata={
        "help": "data-parallel replicas; default: all devices / (pp*fs)"})
    pp: int = field(default=1, metadata={"help": "pipeline stages (model split by layers)"})
    fs: int = field(default=1, metadata={
        "help": "filter split: output channels of each layer over fs actors"})
    plan: str = field(default="none", metadata={
        "help": "per-layer plan; krizhevsky2014 = conv data parallel, FC split", "choices": PLAN_CHOICES})
    num_microbatches: int = field(default=1, metadata={"help": "micro-batches per replica per step"})
    schedule: str = field(default="1f1b", metadata={"help": "pipeline schedule", "choices": SCHEDULE_CHOICES})
    virtual_stages: int = field(default=1, metadata={
        "help": "model chunks per pipeline stage: above 1, interleaved 1F1B (Megatron-LM), a smaller bubble "
                "for more point-to-point messages; needs --num-microbatches a multiple of --pp"})
    exchange_chunks: int = field(default=1, metadata={
        "help": "filter split: gather the input of each layer that needs all channels in this many pieces "
                "along the batch, so that one piece's exchange runs while the layer computes another "
                "(forward and backward); 1: one exchange per layer, waited for"})


@dataclass(frozen=True)
class LayoutSettings(LayoutFields):
    """The layout with how it and its pipeline cut are chosen: by hand, or by the planner within a memory
    limit."""

    stages: Optional[str] = field(default=None, metadata={
        "help": "pipeline cut points by hand, e.g. '5,9' (layer indices)"})
    balance: str = field(default="auto", metadata={
        "help": "what pipeline stages balance when --stages is not given: time (each layer's "
                "forward+backward measured on one device before the run), flops (forward FLOPs), auto (time "
                "on GPUs, flops on CPU)", "choices": BALANCE_CHOICES})
    layout: str = field(default="manual", metadata={
        "help": "auto: the planner (python -m rayconv.plan) measures layer and link times, ranks every "
                "layout and runs the fastest that fits --max-memory-gib, replacing "
                "--dp/--pp/--fs/--plan/--num-microbatches/--schedule/--virtual-stages; manual: those flags",
        "choices": LAYOUT_CHOICES})
    max_memory_gib: Optional[float] = field(default=None, metadata={
        "help": "refuse (exit 2, before any actor starts) a layout whose predicted peak memory per device "
                "exceeds this many GiB; 6 is Yadan et al.'s TITAN (default: no limit)"})


@dataclass(frozen=True)
class RecipeSettings:
    """The training recipe (synchronous SGD): batch, length, learning rate and its schedule, optimizer,
    regularisation, weight average, seed; what every layout computes alike."""

    global_batch_size: int = field(default=64, metadata={"help": "images per step over all replicas"})
    epochs: Optional[int] = field(default=None,
                                  metadata={"help": "epochs to train (default 10 when --steps is not given)"})
    steps: Optional[int] = field(default=None,
                                 metadata={"help": "optimizer steps to train (overrides --epochs)"})
    lr: float = field(default=0.05, metadata={
        "help": "peak learning rate: for the global batch with --lr-scaling none (default 0.05); per 256 "
                "images with --lr-scaling linear, multiplied by global batch / 256"})
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
        "help": "the warm-up's starting fraction of --lr, in (0, 1] (default 0.01; torchvision's recipe "
                "0.01)"})
    opt: str = field(default="sgd", metadata={
        "help": "optimizer: sgd (with --momentum), sgd_nesterov (Nesterov momentum, Sutskever et al. 2013), "
                "lars (layer-wise trust ratios, You et al. 2017; norm layers and biases plain SGD), adamw "
                "(Loshchilov & Hutter 2019)", "choices": OPT_CHOICES})
    lars_trust_coefficient: float = field(default=LARS_ETA, metadata={
        "help": "--opt lars: the trust coefficient eta of each layer's ratio eta ||w|| / (||g|| + wd ||w||)"})
    lr_schedule: str = field(default="cosine",
                             metadata={"help": "learning-rate schedule", "choices": LR_SCHEDULE_CHOICES})
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
        "help": "clip the global gradient norm over all shards to this (> 0, Pascanu et al. 2013); default: "
                "none"})
    mixup_alpha: float = field(default=0.0, metadata={
        "help": "mixup's Beta(alpha, alpha), >= 0, drawn per global batch (Zhang et al. 2018; default 0: "
                "off)"})
    cutmix_alpha: float = field(default=0.0, metadata={
        "help": "CutMix's Beta(alpha, alpha), >= 0, drawn per global batch (Yun et al. 2019; default 0: "
                "off); with mixup too, one of the two per batch"})
    model_ema: bool = field(default=False, metadata={
        "help": "keep an exponential moving average of the weights, evaluate it after each evaluation and "
                "write model_ema.pt (torchvision's --model-ema; default off)"})
    model_ema_steps: int = field(default=32,
                                 metadata={"help": "steps between EMA updates, >= 1 (default 32)"})
    model_ema_decay: float = field(default=0.99998, metadata={
        "help": "EMA decay in [0, 1], adjusted for the batch and --model-ema-steps as torchvision's train.py "
                "does (default 0.99998, torchvision's)"})
    sync_batchnorm: bool = field(default=False, metadata={
        "help": "batch-norm statistics over the global batch (SyncBatchNorm, GPUs only)"})
    bn_momentum: Optional[float] = field(default=None, metadata={
        "help": "momentum of every batch norm's running statistics, in (0, 1] (torch's BatchNorm momentum: "
                "the weight of each step's batch statistics; default: the model's own, 0.1 for torch's "
                "layers)"})
    precise_bn_batches: int = field(default=0, metadata={
        "help": "before each evaluation, recompute every batch norm's running statistics as the average "
                "over the next N training batches (train mode, no gradients; precise BN, Wu and Johnson "
                "2021, section 3), of the moving average too with --model-ema; >= 0 (default 0: off)"})
    seed: int = field(default=0, metadata={"help": "seed of weights, data order and augmentation"})


@dataclass(frozen=True)
class ExecutionSettings:
    """How each actor computes its step: number format, compilation, CUDA graphs, cuDNN, gradient buckets."""

    precision: str = field(default="fp32", metadata={
        "help": "fp32, bf16 (autocast), fp16 (autocast with dynamic loss scaling, Micikevicius et al. 2018) "
                "or fp64", "choices": PRECISION_CHOICES})
    compile: str = field(default="auto", metadata={
        "help": "torch.compile each actor's part, in segments that end at the gradient bucket size: on, off, "
                "or auto: on with GPUs (except fp64; with --cuda-graphs off, one-GPU runs only), where it "
                "was measured to pay; compile time is spent in the first step", "choices": COMPILE_CHOICES})
    cuda_graphs: str = field(default="auto", metadata={
        "help": "capture each actor's whole training step (forward, backward, exchanges, all-reduce, update) "
                "as one CUDA graph and replay it, so the CPU launches one graph a step, not every kernel: "
                "on, off, or auto: on with GPUs; refused on CPU", "choices": COMPILE_CHOICES})
    cudnn_benchmark: str = field(default="auto", metadata={
        "help": "let cuDNN time its algorithms for each new convolution shape "
                "(torch.backends.cudnn.benchmark): on, off, or auto: on for runs of at least "
                f"{CUDNN_BENCHMARK_MIN_STEPS:,} steps, where its faster steps repay the seconds of timing at "
                "the first step, the last partial batch and the first evaluation",
        "choices": COMPILE_CHOICES})
    bucket_mb: float = field(default=25.0, metadata={
        "help": "gradient all-reduce bucket size in MB (2**20 bytes); compiled segments end at bucket "
                "boundaries"})


@dataclass(frozen=True)
class ClusterSettings:
    """Where the actors run: device, Ray cluster, resources per actor, collective time-out."""

    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda", "choices": DEVICE_CHOICES})
    address: Optional[str] = field(default=None, metadata={
        "help": "Ray cluster address (default: RAY_ADDRESS, a running cluster, else a new local one)"})
    num_cpus_per_actor: int = field(default=1, metadata={"help": "CPUs reserved per actor (threads on CPU)"})
    gpus_per_actor: float = field(default=1.0, metadata={
        "help": "share of a GPU reserved per actor, in (0, 1] (e.g. 0.25: four actors per GPU), so that "
                "small runs or a search's trials share GPUs; below 1 the model's predicted peak memory must "
                "fit in that share of the GPU's memory (default 1)"})
    all_gpus_visible: bool = field(default=True, metadata={
        "help": "actors see every GPU of their node and pick theirs by index, as torchrun does (with Ray's "
                "one GPU per actor, NCCL is reported to slow or hang on NVSwitch hosts, Ray issue 61073); "
                "no effect on CPU or for a layout of one actor"})
    collective_timeout_s: float = field(default=300.0, metadata={
        "help": "seconds before a stuck collective fails"})
    keep_actors_s: float = field(default=60.0, metadata={
        "help": "seconds a finished run's actors stay, for the next run that needs the same actors to reuse "
                "their started processes: of the same Python process (rayconv.fit), or, for a command on a "
                "cluster that outlives it (ray start --head, then --address or none), the next command on "
                "that cluster; 0: stopped at the run's end"})


@dataclass(frozen=True)
class OutputSettings:
    """What a run writes and reports: output folder, evaluations, progress, metrics."""

    out: Optional[str] = field(default=None,
                               metadata={"help": "output folder (default: a new folder under runs/)"})
    eval_every: Optional[int] = field(default=None, metadata={
        "help": "steps between test evaluations (default: each epoch)"})
    val_split: float = field(default=0.0, metadata={
        "help": "hold out this fraction of the train images, in [0, 1), drawn from --seed (the same images "
                "in every layout and on resume), never trained on and evaluated unaugmented as val_*; "
                "--target-accuracy and --keep-best then read the validation accuracy, and the test split is "
                "evaluated at the end only (or with --eval-test) (default: 0, none)"})
    eval_test: bool = field(default=False, metadata={
        "help": "with --val-split: evaluate the test split at every evaluation too, not only at the end"})
    keep_best: bool = field(default=False, metadata={
        "help": "with --val-split: write <out>/best/model.pt (atomically) at each evaluation that improves "
                "the validation accuracy; summary.json's best_step and best_val_accuracy say which"})
    tensorboard: str = field(default="on", metadata={
        "help": "TensorBoard event files in <out>/tensorboard/ (needs the tensorboard package; without it a "
                "run goes on without them)", "choices": ("on", "off")})
    log_images: int = field(default=0, metadata={
        "help": "with --tensorboard on: a grid of this many augmented training images of the first batch, "
                "once (default: 0, none)"})
    target_accuracy: Optional[float] = field(default=None, metadata={
        "help": "record the first evaluation whose top-1 accuracy (validation with --val-split, else test) "
                "reaches this, in (0, 1]: summary.json's time_to_target_s (wall-clock from the start) and "
                "time_to_target_train_s (the steps' time); training goes on (default: none)"})
    log_every: int = field(default=10, metadata={"help": "steps between progress lines"})
    progress: bool = field(default=True, metadata={
        "help": "a progress bar on a terminal (plain lines every --log-every steps otherwise)"})
    metrics: bool = field(default=True, metadata={"help": "export per-actor and per-run gauges to Ray's "
                                                          "metrics (dashboard Metrics view, Prometheus)"})


@dataclass(frozen=True)
class OperationsSettings:
    """Checkpoints, resume and recovery from failures."""

    checkpoint_every: int = field(default=0, metadata={"help": "steps between checkpoints written to "
                                                               "<out>/checkpoints/step-<k>/ (0: none)"})
    keep_checkpoints: int = field(default=2, metadata={
        "help": "newest checkpoints kept; older ones are deleted (0: keep all)"})
    resume: Optional[str] = field(default=None, metadata={
        "help": "continue from a checkpoint: a run folder (its newest checkpoint) or a checkpoints/step-<k> "
                "folder; settings come from it, flags given override them"})
    max_failures: Optional[int] = field(default=None, metadata={
        "help": "actor failures (process or node lost, collective timeout) to recover from by restarting the "
                "actors and reloading the last checkpoint; -1: no limit (Ray Train's FailureConfig reads it "
                "alike); default 0, with --elastic -1 (every loss recovered while --elastic MIN actors fit)"})
    max_wait: float = field(default=120.0, metadata={
        "help": "seconds the start-up may take: the cluster having resources for all actors, then the actors "
                "starting (at start and after a failure)"})
    elastic: Optional[int] = field(default=None, metadata={
        "help": "the fewest actors the run may continue on: an actor or node lost (or preempted) makes it "
                "re-plan on the devices left and grow back at checkpoints; needs --checkpoint-every; every "
                "loss is recovered unless --max-failures N (default: not elastic)"})
    elastic_wait: float = field(default=30.0, metadata={
        "help": "seconds --elastic waits for a lost actor's resources to come back before it re-plans on "
                "fewer"})

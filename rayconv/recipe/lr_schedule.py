"""The learning rate of a step: linear (or constant) warm-up, then cosine decay or a constant rate.

torchvision's reference recipe (references/classification/train.py: ``--lr-warmup-epochs``,
``--lr-warmup-method``, ``--lr-warmup-decay``, ``--lr-scheduler cosineannealinglr``, ``--lr-min``)
chains ``LinearLR(start_factor=warmup_decay, total_iters=W)`` and ``CosineAnnealingLR(T_max=T - W,
eta_min=min_lr)`` with ``SequentialLR``; ``schedule_lr`` is that chain in closed form, counted in
optimizer steps rather than epochs: Goyal et al. 2017 ("Accurate, Large Minibatch SGD", section 2.2,
gradual warm-up) raise the rate by a constant amount every iteration. A pure function of the step, so
the driver can hand each step its rate and a resumed run continues on the same curve.
"""

from __future__ import annotations

import math

from rayconv.errors import ConfigError

SCHEDULES = ("cosine", "constant")
WARMUP_METHODS = ("linear", "constant")


def schedule_lr(step: int, total_steps: int, base_lr: float, warmup_steps: int = 0,
                warmup_decay: float = 0.01, schedule: str = "cosine", warmup_method: str = "linear",
                min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based) in a run of ``total_steps`` steps.

    Warm-up, steps ``0 <= step < warmup_steps``: ``linear`` goes from ``base_lr * warmup_decay`` at step 0
    by equal increments towards ``base_lr`` (reached at ``step == warmup_steps``), as ``LinearLR``;
    ``constant`` holds ``base_lr * warmup_decay``, as ``ConstantLR``. After it, ``cosine`` is
    ``min_lr + (base_lr - min_lr) * (1 + cos(pi * t / (total_steps - warmup_steps))) / 2`` with
    ``t = step - warmup_steps`` (``CosineAnnealingLR``, Loshchilov & Hutter 2017, SGDR, eq. 5, one
    cycle), held at ``min_lr`` from ``total_steps`` on; ``constant`` is ``base_lr``.
    Raises ConfigError for a negative step or count, an unknown schedule or method, a
    ``warmup_decay`` outside (0, 1], or ``warmup_steps > total_steps``.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown learning-rate schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if warmup_method not in WARMUP_METHODS:
        raise ConfigError(
            f"unknown --lr-warmup-method {warmup_method!r}: use one of {', '.join(WARMUP_METHODS)}")
    if step < 0 or total_steps < 0 or warmup_steps < 0:
        raise ConfigError(f"step ({step}), total steps ({total_steps}) and warm-up steps ({warmup_steps}) "
                          "must be >= 0")
    if warmup_steps > total_steps:
        raise ConfigError(f"the warm-up ({warmup_steps} steps) is longer than the run ({total_steps} steps): "
                          "lower --lr-warmup-epochs")
    if not 0.0 < warmup_decay <= 1.0:
        raise ConfigError(f"--lr-warmup-decay must be in (0, 1] (got {warmup_decay})")
    if step < warmup_steps:
        if warmup_method == "constant":
            return base_lr * warmup_decay
        return base_lr * (warmup_decay + (1.0 - warmup_decay) * step / warmup_steps)
    if schedule == "constant":
        return base_lr
    t = min(step, total_steps) - warmup_steps
    span = max(1, total_steps - warmup_steps)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t / span))


def scaled_lr(lr: float, global_batch_size: int, reference: int = 256) -> float:
    """The linear scaling rule: ``lr`` given for a batch of ``reference`` samples, scaled to
    ``global_batch_size`` (Goyal et al. 2017, section 2.1: "when the minibatch size is multiplied by k,
    multiply the learning rate by k"; their reference is 0.1 for 256 images). Meant together with a
    warm-up (section 2.2), without which large batches diverge early. Raises ConfigError for a batch or
    reference size below 1.
    """
    if global_batch_size < 1 or reference < 1:
        raise ConfigError(
            f"batch sizes must be >= 1 (got global batch {global_batch_size}, reference {reference})")
    return lr * global_batch_size / reference

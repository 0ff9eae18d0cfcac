"""The learning rate the driver hands each step: ``rayconv.recipe.lr_schedule.schedule_lr`` on the run's
settings.

``--lr-warmup-epochs`` counts in epochs, the schedule in optimizer steps: the warm-up is
``lr_warmup_epochs x steps_per_epoch`` steps (torchvision's train.py with ``--lr-warmup-epochs`` steps
its scheduler per epoch; counting per step raises the rate a little every iteration, as Goyal et al.
2017, section 2.2, do). With ``--lr-scaling linear`` the peak rate is ``--lr x global batch / 256``
(section 2.1). The rate is a pure function of the step, so a resumed run continues on the same curve.
"""

from __future__ import annotations

from typing import Optional

from rayconv.errors import ConfigError
from rayconv.recipe.lr_schedule import scaled_lr, schedule_lr
from rayconv.settings import RecipeSettings


def total_steps(cfg: RecipeSettings, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: ``--steps``, else ``--epochs`` (10 when neither is given) epochs."""
    return cfg.steps or (cfg.epochs or 10) * steps_per_epoch


def warmup_steps(cfg: RecipeSettings, steps_per_epoch: Optional[int]) -> int:
    """Steps of the learning-rate warm-up: ``--lr-warmup-epochs`` x ``steps_per_epoch`` (which is only
    needed when there is a warm-up)."""
    if cfg.lr_warmup_epochs == 0:
        return 0
    assert steps_per_epoch is not None, "a warm-up in epochs needs the run's steps per epoch"
    return cfg.lr_warmup_epochs * steps_per_epoch


def peak_lr(cfg: RecipeSettings) -> float:
    """The rate after the warm-up, before any decay: ``--lr``, or with ``--lr-scaling linear`` ``--lr``
    per 256 images scaled to the global batch."""
    return scaled_lr(cfg.lr, cfg.global_batch_size) if cfg.lr_scaling == "linear" else cfg.lr


def learning_rate(cfg: RecipeSettings, step: int, total: int, steps_per_epoch: Optional[int] = None) -> float:
    """The learning rate of ``step`` (0-based) of a run of ``total`` steps: the warm-up, then cosine
    decay to 0 at ``total`` (Loshchilov & Hutter 2017) or the constant peak. Without a warm-up this is
    ``lr x (1 + cos(pi x step / total)) / 2`` (cosine) or ``lr`` (constant). Raises ConfigError when
    the warm-up is longer than the run."""
    return schedule_lr(step, total, peak_lr(cfg), warmup_steps(cfg, steps_per_epoch), cfg.lr_warmup_decay,
                       cfg.lr_schedule, cfg.lr_warmup_method)


def check_schedule(cfg: RecipeSettings, steps_per_epoch: int) -> None:
    """Refuse a warm-up longer than the run (before any actor starts). Raises ConfigError."""
    total, warm = total_steps(cfg, steps_per_epoch), warmup_steps(cfg, steps_per_epoch)
    if warm > total:
        raise ConfigError(f"--lr-warmup-epochs {cfg.lr_warmup_epochs} is {warm} steps ({steps_per_epoch} per "
                          f"epoch), longer than the run's {total} steps: lower it, or raise --epochs/--steps")

"""The training recipe of the field, under torchvision's reference-script names, as pure building blocks.

Each module is one flag family of references/classification/train.py, written so that every layout of
the mesh (dp x pp x fs) takes the same step as one device: ``schedule`` (``--lr-warmup-*``, cosine,
the linear scaling rule), ``optim`` (``--opt``, ``--norm-weight-decay``, ``--bias-weight-decay``),
``loss`` (``--label-smoothing``, soft targets, the global-batch sum), ``mix`` (``--mixup-alpha``,
``--cutmix-alpha``, drawn per global batch), ``ema`` (``--model-ema``, per part), ``clip``
(``--clip-grad-norm`` over all parts) and ``loss_scale`` (float16 dynamic loss scaling agreed over the
mesh). No module here communicates: the caller all-reduces what the docstrings name.
"""

from rayconv.recipe.clip import clip_, clip_coefficient, local_sq_norm
from rayconv.recipe.ema import PartEMA, torchvision_ema_decay
from rayconv.recipe.loss import cross_entropy, microbatch_loss
from rayconv.recipe.loss_scale import DynamicLossScale, local_overflow, unscale_
from rayconv.recipe.mix import (
    MixDraw,
    cutmix_box,
    draw_mix,
    mix_images,
    mix_targets,
    partner_positions,
    soft_targets,
)
from rayconv.recipe.optim import NORM_CLASSES, OPTIMIZERS, group_of, make_optimizer, param_groups
from rayconv.recipe.lr_schedule import SCHEDULES, WARMUP_METHODS, scaled_lr, schedule_lr

__all__ = ["DynamicLossScale", "MixDraw", "NORM_CLASSES", "OPTIMIZERS", "SCHEDULES", "PartEMA",
           "WARMUP_METHODS", "clip_", "clip_coefficient", "cross_entropy", "cutmix_box", "draw_mix",
           "group_of", "local_overflow", "local_sq_norm", "make_optimizer",
           "microbatch_loss", "mix_images", "mix_targets", "param_groups", "partner_positions", "scaled_lr",
           "schedule_lr", "soft_targets", "torchvision_ema_decay", "unscale_"]

"""The training recipe on an actor: its optimizer, and what a step does between the gradient all-reduce
and the update (float16 loss scaling, gradient clipping) and after it (the moving average).

Built from the pure blocks of ``rayconv.recipe``, which do not communicate; this module adds the
collectives that make every layout take the same step as one device:

* the optimizer (``--opt``, ``--norm-weight-decay``, ``--bias-weight-decay``): ``recipe.optim``'s groups
  of this actor's part; every update is elementwise, so no communication;
* ``--precision fp16``: the loss is multiplied by the ``DynamicLossScale``'s scale, the gradients are
  unscaled after the data-parallel all-reduce, and this actor's overflow flag is all-reduced with MAX
  over the whole mesh (the world group) before the scale changes or any parameter moves, so every
  actor skips the same steps and holds the same scale;
* ``--clip-grad-norm``: the squared gradient norm of what this actor holds, summed over the actors
  that hold different parts of one replica (filter split, then pipeline; the dp group under
  Krizhevsky 2014's per-layer plan), parameters that several of them hold counted once
  (``recipe.clip``), then every actor scales by the same coefficient;
* ``--opt lars``: after clipping, each layer's gradient is scaled by its trust ratio (``recipe.lars``),
  the squared norms of a tensor split over filter-split slices (the dp group under the per-layer plan)
  summed over them first, so each slice takes the whole tensor's ratio;
* ``--model-ema``: ``recipe.ema.PartEMA`` over this actor's part, updated after the step as
  torchvision's train.py updates its ``ExponentialMovingAverage``: at batch ``i`` of an epoch with
  ``i % model_ema_steps == 0``, the count reset after each update during the warm-up epochs, the
  decay adjusted by ``torchvision_ema_decay`` for the run's epochs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rayconv.config import Config
from rayconv.mesh import Coord
from rayconv.parallel import comm
from rayconv.parallel.parallelize import ParallelPart
from rayconv.recipe.clip import clip_, clip_coefficient, local_sq_norm
from rayconv.recipe.ema import PartEMA, torchvision_ema_decay
from rayconv.recipe.lars import adapted_params, lars_param_groups, scale_, sq_norms
from rayconv.recipe.loss_scale import DynamicLossScale, unscale_
from rayconv.recipe.optim import make_optimizer, param_groups
from rayconv.settings import RecipeSettings


def build_optimizer(cfg: RecipeSettings, part: nn.Module) -> torch.optim.Optimizer:
    """``cfg.opt`` over ``part``'s parameter groups (``recipe.optim``). A part without parameters (a
    stage of pooling alone) gets one empty group, so the optimizer's state_dict has a fixed shape."""
    make_groups = lars_param_groups if cfg.opt == "lars" else param_groups
    groups = make_groups(part, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    if not groups:
        groups = [{"params": [], "weight_decay": cfg.weight_decay, "name": "other"}]
    return make_optimizer(groups, cfg.opt, cfg.lr, cfg.momentum, cfg.weight_decay)


def run_epochs(cfg: RecipeSettings, steps_per_epoch: int) -> int:
    """The epochs the run spans, for the EMA decay adjustment: ``--steps`` rounded up to whole epochs
    when given (it overrides ``--epochs``), else ``--epochs`` (10 when neither is given)."""
    if cfg.steps:
        return max(1, -(-cfg.steps // steps_per_epoch))
    return cfg.epochs or 10


def ema_decay(cfg: RecipeSettings, steps_per_epoch: int) -> float:
    """The per-update decay of the moving average: ``--model-ema-decay`` adjusted as torchvision's
    train.py adjusts it for the global batch, ``--model-ema-steps`` and the run's epochs."""
    return torchvision_ema_decay(cfg.model_ema_decay, cfg.global_batch_size, cfg.model_ema_steps,
                                 run_epochs(cfg, steps_per_epoch))


class RecipeStep:
    """One actor's loss scale, clipping and moving average (each None or off when its flag is).

    ``scaler``: the ``DynamicLossScale`` under fp16; ``ema``: the ``PartEMA`` under --model-ema;
    ``skipped``: whether the last step was skipped for an overflow; ``overflow_at``: a test hook, the
    step at which this actor's gradients are made to overflow (``Actor.inject_overflow``)."""

    def __init__(self, cfg: Config, parallel: ParallelPart, optimizer: torch.optim.Optimizer,
                 groups: comm.Groups, coord: Coord, per_layer: bool, device: torch.device,
                 steps_per_epoch: int):
        self.cfg, self.groups, self.device = cfg, groups, device
        self.steps_per_epoch = steps_per_epoch
        self.params = [p for p in parallel.part.parameters() if p.requires_grad]
        self.scaler = DynamicLossScale() if cfg.precision == "fp16" else None
        self.skipped = False
        self.overflow_at: Optional[int] = None
        # Clipping: split parameters count on every holder, replicated ones on one holder of the group.
        split_keys = parallel.sliced.split_dims
        self.split, self.whole = [], []
        for name, sub in zip(parallel.names, parallel.part):
            for k, p in sub.named_parameters():
                if p.requires_grad:
                    (self.split if (f"{name}.{k}" if name else k) in split_keys else self.whole).append(p)
        self.count_whole = coord.dp == 0 if per_layer else coord.fs == 0
        self.norm_groups = [groups.axis["dp"]] if per_layer else [groups.axis["fs"], groups.axis["pp"]]
        # LARS: its tensors, split ones first (their norms are summed over the split group), and decays.
        split_ids = {id(p) for p in self.split}
        pairs = sorted(adapted_params(optimizer), key=lambda pw: id(pw[0]) not in split_ids) \
            if cfg.opt == "lars" else []
        self.lars = ([p for p, _ in pairs], [wd for _, wd in pairs],
                     sum(id(p) in split_ids for p, _ in pairs))
        self.lars_group = groups.axis["dp"] if per_layer else groups.axis["fs"]
        self.lars_decays = torch.tensor(self.lars[1], dtype=torch.float64, device=device)
        self.ema = PartEMA(parallel.part, ema_decay(cfg, steps_per_epoch), cfg.model_ema_steps) \
            if cfg.model_ema else None

    @property
    def loss_scale(self) -> Optional[float]:
        """The factor this step's loss is multiplied by (None without fp16)."""
        return None if self.scaler is None else self.scaler.scale

    def before_update(self, step: int) -> bool:
        """After the data-parallel all-reduce: unscale and agree on overflow (fp16), then clip, then LARS.
        Returns True when the step must be skipped (an overflow anywhere in the mesh; the scale is backed
        off). Collective: over the world group under fp16, over the norm groups with clipping."""
        self.skipped = False
        if self.scaler is not None:
            if self.overflow_at == step and self.params:  # (test hook; see Actor.inject_overflow)
                self.params[0].grad.view(-1)[0] = float("inf")
            found = unscale_(self.params, self.scaler.scale, self.device)
            comm.all_reduce_max(found, self.groups.world)
            self.skipped = self.scaler.update(found)  # (reads the agreed flag: synchronises)
            if self.skipped:
                return True
        if self.cfg.clip_grad_norm is not None:
            total = local_sq_norm(self.split, self.whole, self.count_whole, self.device)
            for g in self.norm_groups:
                comm.all_reduce_sum(total, g)
            clip_(self.params, clip_coefficient(total, self.cfg.clip_grad_norm))
        if self.cfg.opt == "lars":
            self._lars()
        return False

    def _lars(self) -> None:
        """Scale each adapted gradient by its whole tensor's trust ratio (collective over the split
        group when this actor holds split tensors)."""
        params, decays, n_split = self.lars
        sq = sq_norms(params, self.device)
        if n_split:
            part = sq[:, :n_split].contiguous()
            comm.all_reduce_sum(part, self.lars_group)
            sq = torch.cat([part, sq[:, n_split:]], dim=1)
        scale_(params, decays, sq, self.cfg.lars_trust_coefficient, self.lars_decays)

    def after_update(self, part: nn.Module, step: int) -> None:
        """Fold the updated part into the moving average at the update steps (torchvision's batch index
        within the epoch), resetting its count during the warm-up epochs."""
        if self.ema is None:
            return
        epoch, i = divmod(step, self.steps_per_epoch)
        self.ema.update(part, i, reset=epoch < self.cfg.lr_warmup_epochs)

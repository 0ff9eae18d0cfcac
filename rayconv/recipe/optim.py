"""Optimizer parameter groups (no weight decay on normalisation layers) and the optimizers of the recipe.

``param_groups`` follows torchvision's ``set_weight_decay`` (references/classification/utils.py, used by
train.py's ``--norm-weight-decay`` and ``--bias-weight-decay``): a parameter belongs to the group of the
module that holds it, so the grouping is decided per parameter from its own module's type and its own
name, never from its position in the model. A model part (an ``nn.Module`` holding some of the
model's layers, as a pipeline stage or a filter-split part does) therefore puts each of its parameters
in the same group as the whole model would, provided its layers keep a normalisation class (a
filter-split ``BatchNorm2d``, rayconv's ``DeferredBatchNorm`` and torch's ``SyncBatchNorm`` are all
subclasses of ``_BatchNorm``).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from rayconv.errors import ConfigError

# torchvision's default norm_classes in set_weight_decay (and ops._utils.split_normalization_params).
NORM_CLASSES: tuple[type, ...] = (_BatchNorm, nn.LayerNorm, nn.GroupNorm, _InstanceNorm, nn.LocalResponseNorm)
OPTIMIZERS = ("sgd", "sgd_nesterov", "lars", "adamw")


def group_of(module: nn.Module, norm_weight_decay: Optional[float] = None,
             bias_weight_decay: Optional[float] = None) -> dict[str, str]:
    """Each trainable parameter's group, by its name in ``module``: ``"bias"`` for a parameter named
    ``bias`` when ``bias_weight_decay`` is given (also a norm layer's bias, as torchvision's custom key
    ``"bias"``), else ``"norm"`` for parameters of a ``NORM_CLASSES`` module when ``norm_weight_decay``
    is given, else ``"other"``. A parameter shared by several modules counts once, under its first
    name (``named_parameters``' order)."""
    groups: dict[str, str] = {}
    seen: set[int] = set()
    for prefix, m in module.named_modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                seen.add(id(p))
                continue
            seen.add(id(p))
            full = f"{prefix}.{name}" if prefix else name
            if bias_weight_decay is not None and name == "bias":
                groups[full] = "bias"
            elif norm_weight_decay is not None and isinstance(m, NORM_CLASSES):
                groups[full] = "norm"
            else:
                groups[full] = "other"
    return groups


def param_groups(module: nn.Module, weight_decay: float, norm_weight_decay: Optional[float] = None,
                 bias_weight_decay: Optional[float] = None) -> list[dict[str, Any]]:
    """``torch.optim`` parameter groups of ``module`` (a whole model or a part of one).

    Groups, in this order and only when not empty: ``other`` (``weight_decay``), ``norm``
    (``norm_weight_decay``), ``bias`` (``bias_weight_decay``); see ``group_of``. Each group dict holds
    ``params`` (in ``named_parameters`` order), ``weight_decay`` and ``name`` (torch keeps the extra key
    in ``optimizer.param_groups`` and ``state_dict``, so callers can find a group by name on parts
    whose empty groups were left out). Frozen parameters (``requires_grad=False``) are left out, as in
    torchvision. Raises ConfigError for a negative decay.
    """
    for label, wd in (("--weight-decay", weight_decay), ("--norm-weight-decay", norm_weight_decay),
                      ("--bias-weight-decay", bias_weight_decay)):
        if wd is not None and wd < 0:
            raise ConfigError(f"{label} must be >= 0 (got {wd})")
    decay = {"other": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    where = group_of(module, norm_weight_decay, bias_weight_decay)
    params = dict(module.named_parameters())
    out = []
    for key in ("other", "norm", "bias"):
        ps = [params[n] for n, g in where.items() if g == key]
        if ps:
            out.append({"params": ps, "weight_decay": decay[key], "name": key})
    return out


def make_optimizer(groups: list[dict[str, Any]], opt: str, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer ``opt`` over ``groups`` (from ``param_groups``), as torchvision's train.py builds it.

    ``sgd``: ``torch.optim.SGD(momentum, weight_decay)`` (coupled L2 decay, heavy-ball momentum);
    ``sgd_nesterov``: the same with Nesterov momentum (Sutskever et al. 2013) and ``momentum > 0``;
    ``lars``: ``torch.optim.SGD(momentum)`` over ``recipe.lars.lars_param_groups`` (the trust ratio
    scales the gradients before it, ``actor.recipe_step``);
    ``adamw``: ``torch.optim.AdamW(weight_decay)`` (decoupled decay, Loshchilov & Hutter 2019), its
    betas and eps torch's defaults. ``weight_decay`` applies to groups without their own. Every update
    is elementwise per parameter, so a part's optimizer moves its slice of a parameter exactly as the
    whole model's optimizer moves that slice. Raises ConfigError for an unknown ``opt``, ``lr <= 0``, a
    negative momentum, or Nesterov without momentum.
    """
    if opt not in OPTIMIZERS:
        raise ConfigError(f"unknown --opt {opt!r}: use one of {', '.join(OPTIMIZERS)}")
    if not lr > 0:
        raise ConfigError(f"--lr must be > 0 (got {lr})")
    if momentum < 0:
        raise ConfigError(f"--momentum must be >= 0 (got {momentum})")
    if opt == "adamw":
        return AdamW(groups, lr=lr, weight_decay=weight_decay)
    if opt == "sgd_nesterov" and momentum == 0:
        raise ConfigError("--opt sgd_nesterov needs --momentum > 0")
    return SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay,
               nesterov=opt == "sgd_nesterov")  # (lars: heavy-ball momentum)


class _Eager:
    """torch.optim's own methods without the wrappers that keep torch.compile from tracing into them
    (``torch._disable_dynamo``; ``_use_grad_for_differentiable`` around ``step``). Each wrapper imports
    torch._dynamo at its first call, an import nearly as costly as torch's own in every actor's process,
    and rayconv never compiles an optimizer. The step runs under ``torch.no_grad``, the grad mode that
    wrapper sets for an optimizer that is not ``differentiable``; the arithmetic, state and
    ``state_dict`` are torch's."""

    add_param_group = inspect.unwrap(torch.optim.Optimizer.add_param_group)
    zero_grad = inspect.unwrap(torch.optim.Optimizer.zero_grad)
    state_dict = inspect.unwrap(torch.optim.Optimizer.state_dict)
    load_state_dict = inspect.unwrap(torch.optim.Optimizer.load_state_dict)


class SGD(_Eager, torch.optim.SGD):
    """``torch.optim.SGD`` (``_Eager``)."""

    step = torch.no_grad()(inspect.unwrap(torch.optim.SGD.step))


class AdamW(_Eager, torch.optim.AdamW):
    """``torch.optim.AdamW`` (``_Eager``)."""

    step = torch.no_grad()(inspect.unwrap(torch.optim.AdamW.step))

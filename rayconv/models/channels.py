"""The image channels a model takes, found from the model itself.

A user's FUNCTION that names no ``in_channels`` (``def build(num_classes=10, **kwargs)``) builds a
model whose channel count only the model knows. ``first_convolution`` finds the first convolution its
forward applies: a dry forward on the meta device, stopped by a forward pre-hook at that convolution's
call (so neither the order in which the model defines its modules nor a mismatching channel count
matters; any forward that runs on meta up to there works, data-dependent control flow after it too).
``user_model_channels`` gives grey data to such a model as 1 channel or as 3 equal ones accordingly.
``channel_mismatch`` is the one-line error for a model given another count than its convolution takes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from rayconv.user_model import build_user_model

CONVOLUTIONS = (nn.modules.conv._ConvNd,)  # Conv1d/2d/3d and their transposed and lazy forms


def dry_forward(model: nn.Module, shape: tuple[int, ...], device: str = "meta") -> Any:
    """``model``'s training forward of 2 zero images of ``shape`` (C, H, W) on ``device``, on copies of
    its tensors (the model's own untouched, its training flag and torch's CPU RNG state restored).
    Raises what the forward raises."""
    state = {n: t.detach().to("meta") if device == "meta" else t.detach().clone()
             for n, t in [*model.named_parameters(), *model.named_buffers()]}
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return torch.func.functional_call(model, state, (torch.zeros((2, *shape), device=device),))
    finally:
        model.train(was_training)


class _Reached(Exception):
    """Raised by the pre-hook of the first convolution called: stops the dry forward there."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__(name)
        self.name, self.module = name, module


def first_convolution(model: nn.Module, shape: tuple[int, ...]) -> Optional[tuple[str, nn.Module]]:
    """(qualified name, module) of the first convolution ``model``'s forward calls on images of
    ``shape`` (C, H, W; meta device), or None where it calls none or fails before reaching one."""
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, CONVOLUTIONS)]
    if not convs:
        return None

    def stop(name: str):
        def hook(module: nn.Module, args: Any) -> None:
            raise _Reached(name, module)
        return hook

    handles = [m.register_forward_pre_hook(stop(n)) for n, m in convs]
    try:
        dry_forward(model, shape)
    except _Reached as r:
        return r.name, r.module
    except Exception:  # noqa: BLE001 - a forward that fails before any convolution tells nothing
        return None
    finally:
        for h in handles:
            h.remove()
    return None


def user_model_channels(name: str, num_classes: int, image_hw: tuple[int, int]) -> int:
    """The channels to give grey images of ``image_hw`` (H, W) to the user's model ``name`` whose
    FUNCTION is not told its channels: its first convolution's ``in_channels`` where that is 1 or 3;
    for a model without one, 1 where a dry forward of grey images passes, else 3 (3 also for a model
    that cannot be built or run dry here: ``check_trainable`` then reports its error). The model is
    built on the meta device (no memory, no initialisation compute), on the CPU where that fails."""
    try:
        with torch.random.fork_rng(devices=[]):
            try:
                with torch.device("meta"):
                    model = build_user_model(name, num_classes, 1, image_hw[0])
            except Exception:  # noqa: BLE001 - a builder that needs real tensors: built on the CPU
                model = build_user_model(name, num_classes, 1, image_hw[0])
    except Exception:  # noqa: BLE001 - build_model raises the builder's error when the run builds it
        return 3
    found = first_convolution(model, (1, *image_hw))
    if found is not None:
        return found[1].in_channels if found[1].in_channels in (1, 3) else 3
    try:
        dry_forward(model, (1, *image_hw))
        return 1
    except Exception:  # noqa: BLE001 - not for grey images: given as 3 equal channels
        return 3


def channel_mismatch(name: str, model: nn.Module, shape: tuple[int, ...],
                     data_channels: Optional[int]) -> Optional[str]:
    """The one-line error for ``model`` (``--model name``) given images of ``shape`` (C, H, W) where its
    first convolution takes another channel count, with the fix (``--channels``, where the data, of
    ``data_channels`` own channels, can be given so); None where the channel counts agree."""
    found = first_convolution(model, tuple(shape))
    if found is None or found[1].in_channels == shape[0]:
        return None
    conv, (takes, given) = found[1], (found[1].in_channels, shape[0])
    own = data_channels or given
    what = (f"--model {name} takes {takes}-channel images (first convolution {found[0]!r}: "
            f"{type(conv).__name__}({takes}, ...)), given {given}-channel ones")
    if takes == own or (own == 1 and takes == 3):
        return f"{what}: give --channels {takes}"
    grey = " (or 3: grey images can be given as 3 equal channels)" if own == 1 else \
        " (rayconv gives grey images as 3 channels, not colour images as grey)"
    return f"{what}: build the model for the data's {own}-channel images{grey}"

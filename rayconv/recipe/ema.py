"""An exponential moving average of one actor's part of the model (``--model-ema``).

torchvision's recipe keeps ``ExponentialMovingAverage`` (references/classification/utils.py, an
``AveragedModel`` with ``use_buffers=True``): every ``--model-ema-steps`` steps, each parameter and
buffer ``e`` of the average becomes ``decay * e + (1 - decay) * p`` of the model's ``p``, the first
update copying; during the learning-rate warm-up train.py resets the count after each update, so the
average keeps copying the model until the warm-up ends. The update is elementwise, so the average of a
part (a pipeline stage, a filter-split slice) is the same slice of the whole model's average: each
actor averages what it holds, with no communication, and the checkpoint merges the averages as it
merges the model. Integer buffers (``num_batches_tracked``) are copied, not averaged (torchvision
writes the float average back into the integer tensor, truncating it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rayconv.errors import ConfigError


def torchvision_ema_decay(model_ema_decay: float, global_batch_size: int, model_ema_steps: int,
                          epochs: int) -> float:
    """The decay torchvision's train.py gives its average for ``--model-ema-decay``:
    ``1 - min(1, (1 - model_ema_decay) * global_batch_size * model_ema_steps / epochs)``, its adjustment
    of the per-update decay for the batch size and the update interval (the formula as that script has
    it, ``epochs`` included). Raises ConfigError for a decay outside [0, 1] or counts below 1."""
    if not 0.0 <= model_ema_decay <= 1.0:
        raise ConfigError(f"--model-ema-decay must be in [0, 1] (got {model_ema_decay})")
    if min(global_batch_size, model_ema_steps, epochs) < 1:
        raise ConfigError("batch size, --model-ema-steps and --epochs must be >= 1 for the EMA decay")
    alpha = (1.0 - model_ema_decay) * global_batch_size * model_ema_steps / epochs
    return 1.0 - min(1.0, alpha)


class PartEMA:
    """The moving average of ``module``'s ``state_dict`` tensors (parameters and persistent buffers).

    ``tensors``: state_dict key -> the average (same device, dtype and shape as the module's tensor).
    ``update(module, step)`` averages when ``step % every == 0`` (train.py's ``i % model_ema_steps ==
    0``); ``copy_to(module)`` loads the average into a module of the same layout (to evaluate it).
    Raises ConfigError for ``decay`` outside [0, 1] or ``every < 1``."""

    def __init__(self, module: nn.Module, decay: float, every: int = 1):
        if not 0.0 <= decay <= 1.0:
            raise ConfigError(f"--model-ema-decay must be in [0, 1] (got {decay})")
        if every < 1:
            raise ConfigError(f"--model-ema-steps must be >= 1 (got {every})")
        self.decay, self.every = decay, every
        self.tensors = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.n_averaged = 0  # updates since the last reset; 0: the next update copies

    def update(self, module: nn.Module, step: int, reset: bool = False) -> bool:
        """Fold ``module``'s tensors into the average if ``step`` is an update step; ``reset`` (during
        the warm-up) makes the next update copy again. Returns whether it updated. Raises KeyError
        when ``module``'s keys differ from those the average was made from."""
        if step % self.every != 0:
            return False
        current = module.state_dict()
        if current.keys() != self.tensors.keys():
            raise KeyError(
                f"module keys differ from the average's: {sorted(current.keys() ^ self.tensors.keys())}")
        ema, cur = [], []
        with torch.no_grad():
            for k, v in current.items():
                e = self.tensors[k]
                if self.n_averaged == 0 or not e.is_floating_point():
                    e.copy_(v)
                else:
                    ema.append(e)
                    cur.append(v.detach())
            if ema:
                # decay * e + (1 - decay) * p, each product rounded, as torchvision's ema_avg
                torch._foreach_mul_(ema, self.decay)
                torch._foreach_add_(ema, torch._foreach_mul(cur, 1.0 - self.decay))
        self.n_averaged = 0 if reset else self.n_averaged + 1
        return True

    def copy_to(self, module: nn.Module) -> None:
        """Load the average into ``module`` (same keys and shapes); the module's own values are lost."""
        module.load_state_dict(self.tensors)

    def state_dict(self) -> dict[str, Any]:
        """``decay``, ``every``, ``n_averaged`` and ``tensors`` (the same tensors, not copies)."""
        return {"decay": self.decay, "every": self.every, "n_averaged": self.n_averaged,
                "tensors": self.tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``'s output, copying into the existing tensors (device kept).
        Raises KeyError when its keys differ from this average's."""
        if state["tensors"].keys() != self.tensors.keys():
            raise KeyError("the checkpoint's EMA holds other tensors than this part")
        self.decay, self.every, self.n_averaged = state["decay"], state["every"], state["n_averaged"]
        for k, v in state["tensors"].items():
            self.tensors[k].copy_(v)

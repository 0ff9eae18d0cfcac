"""Mixup and cutmix drawn once per global batch, so that a sample's result is the same in every layout.

Mixup (Zhang et al. 2018, "mixup: Beyond Empirical Risk Minimization", section 2) blends each image and
its one-hot target with a partner's, ``lam * own + (1 - lam) * partner`` with ``lam ~ Beta(a, a)``;
cutmix (Yun et al. 2019, "CutMix", section 3.1) pastes the partner's pixels inside one box and mixes
the targets by the area kept. torchvision's recipe (``--mixup-alpha``, ``--cutmix-alpha``) applies one
of the two per batch, chosen with equal odds when both are on (``RandomChoice``), with the box and
label arithmetic of ``transforms.v2.CutMix``, which ``cutmix_box`` and ``mix_images`` reproduce.

torchvision mixes each GPU's local batch with itself (partner = the previous sample), so its result
depends on how the batch is split. Here ``draw_mix`` draws from (seed, step) alone, for the global
batch: the partner of every position (a permutation, as the mixup and cutmix papers' code draws with
``randperm``), ``lam``, the choice and the box. A replica or micro-batch holding positions ``pos`` of
the global batch reads its own samples and those at ``partner_positions(draw, pos)``; the mixing is
elementwise per sample, so any split gives the same mixed images and targets (the test proves it for
1, 2 and 4 pieces).

Legend: B global batch size, N samples in a piece, C channels, H, W pixels, K classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.nn import functional as F

from rayconv.errors import ConfigError

_STREAM = 0x313C  # this module's own random stream beside the data order's (seed, epoch, 0x5EED)


@dataclass(frozen=True)
class MixDraw:
    """One step's mix of the global batch.

    ``kind``: ``"mixup"`` or ``"cutmix"``. ``lam``: weight of a sample's own target (cutmix: the
    fraction of the image it keeps; mixup: also the weight of its own pixels). ``partner``: (B,) int64,
    ``partner[i]`` the global-batch position whose image and target position ``i`` mixes in.
    ``box``: cutmix's ``(x1, y1, x2, y2)``, pixels ``[y1:y2, x1:x2]`` come from the partner; None for
    mixup."""

    kind: str
    lam: float
    partner: np.ndarray
    box: Optional[tuple[int, int, int, int]] = None


def cutmix_box(lam: float, r_x: int, r_y: int, height: int,
               width: int) -> tuple[tuple[int, int, int, int], float]:
    """The cutmix box centred at pixel (``r_x``, ``r_y``) for area ratio ``1 - lam``, clipped to the
    image, and the adjusted ``lam`` (1 - the box's share of the ``height`` x ``width`` image), exactly as
    torchvision's ``transforms.v2.CutMix``: half-sides ``int(0.5 * sqrt(1 - lam) * W)`` and ``* H``."""
    r = 0.5 * math.sqrt(1.0 - lam)
    r_w_half, r_h_half = int(r * width), int(r * height)
    x1, y1 = max(r_x - r_w_half, 0), max(r_y - r_h_half, 0)
    x2, y2 = min(r_x + r_w_half, width), min(r_y + r_h_half, height)
    return (x1, y1, x2, y2), float(1.0 - (x2 - x1) * (y2 - y1) / (width * height))


def draw_mix(seed: int, step: int, global_batch_size: int, mixup_alpha: float = 0.0,
             cutmix_alpha: float = 0.0, image_size: Optional[tuple[int, int]] = None) -> Optional[MixDraw]:
    """The mix of global step ``step`` of a run seeded ``seed`` (the same in every process), or None when
    both alphas are 0. With both on, mixup or cutmix with probability 1/2 each; ``lam ~ Beta(alpha,
    alpha)`` of the one chosen; a uniform permutation of the ``global_batch_size`` positions; for
    cutmix a uniform box centre over ``image_size`` = (H, W) and ``cutmix_box``. Raises ConfigError for a
    negative alpha, a negative seed or step, or cutmix without ``image_size``."""
    if mixup_alpha < 0 or cutmix_alpha < 0:
        raise ConfigError(
            f"--mixup-alpha and --cutmix-alpha must be >= 0 (got {mixup_alpha}, {cutmix_alpha})")
    if seed < 0 or step < 0 or global_batch_size < 1:
        raise ConfigError(
            f"seed ({seed}) and step ({step}) must be >= 0, the batch ({global_batch_size}) >= 1")
    if mixup_alpha == 0 and cutmix_alpha == 0:
        return None
    rng = np.random.default_rng([seed, step, _STREAM])
    if mixup_alpha > 0 and cutmix_alpha > 0:
        kind = "mixup" if rng.random() < 0.5 else "cutmix"
    else:
        kind = "mixup" if mixup_alpha > 0 else "cutmix"
    alpha = mixup_alpha if kind == "mixup" else cutmix_alpha
    lam = float(rng.beta(alpha, alpha))
    partner = rng.permutation(global_batch_size).astype(np.int64)
    if kind == "mixup":
        return MixDraw("mixup", lam, partner)
    if image_size is None:
        raise ConfigError("--cutmix-alpha needs the image size (H, W) to draw a box")
    height, width = image_size
    r_x, r_y = int(rng.integers(width)), int(rng.integers(height))
    box, lam = cutmix_box(lam, r_x, r_y, height, width)
    return MixDraw("cutmix", lam, partner, box)


def partner_positions(draw: MixDraw, positions: np.ndarray) -> np.ndarray:
    """The global-batch positions whose samples a piece holding ``positions`` (N,) must read as well:
    element ``j`` is the partner of ``positions[j]`` (N,), which may lie in another piece."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= len(draw.partner)):
        raise ValueError(f"positions must lie in [0, {len(draw.partner)}) (the global batch)")
    return draw.partner[positions]


def mix_images(draw: MixDraw, images_NCHW: torch.Tensor, partner_NCHW: torch.Tensor) -> torch.Tensor:
    """The mixed images of a piece: ``images_NCHW`` its own samples, ``partner_NCHW`` theirs at
    ``partner_positions`` (same shape and dtype). Mixup: ``(1 - lam) * partner + lam * own`` (torchvision's
    operation order); cutmix: own pixels with the box taken from the partner. A new tensor."""
    if images_NCHW.shape != partner_NCHW.shape:
        raise ValueError(
            f"partner images {tuple(partner_NCHW.shape)} do not match {tuple(images_NCHW.shape)}")
    if draw.kind == "mixup":
        return partner_NCHW.mul(1.0 - draw.lam).add_(images_NCHW.mul(draw.lam))
    x1, y1, x2, y2 = draw.box
    out = images_NCHW.clone()
    out[..., y1:y2, x1:x2] = partner_NCHW[..., y1:y2, x1:x2]
    return out


def soft_targets(labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Class indices (N,) as one-hot rows (N, K) of ``dtype``; probability rows (N, K) copied as ``dtype``."""
    if labels.dim() == 2:
        return labels.to(dtype, copy=True)
    return F.one_hot(labels.long(), num_classes).to(dtype)


def mix_targets(draw: MixDraw, labels: torch.Tensor, partner_labels: torch.Tensor, num_classes: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The mixed targets (N, K) of a piece: ``(1 - lam) * partner + lam * own`` of the one-hot (or
    probability) rows, as torchvision's ``_mixup_label``; feed them to ``loss.cross_entropy``."""
    own, other = soft_targets(labels, num_classes, dtype), soft_targets(partner_labels, num_classes, dtype)
    if own.shape != other.shape:
        raise ValueError(f"partner labels {tuple(other.shape)} do not match {tuple(own.shape)}")
    return other.mul_(1.0 - draw.lam).add_(own.mul(draw.lam))

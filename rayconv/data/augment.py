"""Batched augmentation and normalisation on NCHW uint8 image tensors, for data held on the device:
one gather kernel per batch for the crop and flip, no per-image Python loop or kernel launch.

``random_crop_flip`` is torchvision's ``RandomCrop(size, padding=pad)`` (zero padding) followed by
``RandomHorizontalFlip``, with each sample's offsets and flip given by the caller, so that they can be
drawn per sample from (seed, epoch, index) alone; ``normalize`` is ``ToDtype(float32, scale=True)``
followed by ``Normalize(mean, std)``; ``resize`` is ``Resize`` with antialiasing.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.nn.functional as F


def crop_flip_params(n: int, pad: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets (n, 2) int64 in [0, 2*pad], flips (n,) bool) drawn from ``generator``: row and column
    of each sample's crop in its padded image, and whether it is mirrored."""
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=generator, device=generator.device)
    flips = torch.randint(0, 2, (n,), generator=generator, device=generator.device).bool()
    return offsets, flips


def random_crop_flip(x: torch.Tensor, pad: int, offsets: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """x (N, C, H, W) -> (N, C, H, W), same dtype: sample ``i`` zero-padded by ``pad`` pixels on every
    side, cropped back to H x W at row ``offsets[i, 0]`` and column ``offsets[i, 1]`` of the padded
    image (each in [0, 2*pad]; ``pad`` for both is the uncropped image), then mirrored left-right where
    ``flips[i]``. ``offsets`` (N, 2) int64 and ``flips`` (N,) bool, on x's device."""
    n, c, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad)) if pad else x                         # (N, C, H+2p, W+2p)
    rows = offsets[:, :1] + torch.arange(h, device=x.device)                  # (N, H)
    cols = offsets[:, 1:] + torch.arange(w, device=x.device)                  # (N, W)
    cols = torch.where(flips[:, None], cols.flip(1), cols)                    # mirrored crops read right to left
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(c, device=x.device)[None, :, None, None]
    return xp[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]    # (N, C, H, W)


def normalize(x: torch.Tensor, mean: Union[Sequence[float], torch.Tensor], std: Union[Sequence[float], torch.Tensor],
              scale: float = 255.0) -> torch.Tensor:
    """x (N, C, H, W) integer pixels -> float32 (N, C, H, W): ``(x / scale - mean[c]) / std[c]``, mean
    and std per channel (C values; float32 tensors on x's device are used without a copy) in units of
    ``scale`` (255 for uint8 images: mean and std in [0, 1])."""
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return (x.to(torch.float32) / scale - m) / s


def resize(x: torch.Tensor, size: int, chunk: int = 4096) -> torch.Tensor:
    """x (N, C, H, W) uint8 -> (N, C, size, size) uint8: bilinear with antialiasing (as torchvision's
    ``Resize``), rounded to the nearest pixel value; ``chunk`` images at a time so that the float copy
    stays small."""
    out = torch.empty((x.shape[0], x.shape[1], size, size), dtype=torch.uint8, device=x.device)
    for start in range(0, x.shape[0], chunk):
        part = x[start:start + chunk].to(torch.float32)
        part = F.interpolate(part, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out[start:start + chunk] = part.round_().clamp_(0, 255).to(torch.uint8)
    return out

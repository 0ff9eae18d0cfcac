"""Batched augmentation and normalisation on NCHW image tensors, for data held on the device: one
gather (pad-crop) or one ``grid_sample`` (resized crop) kernel per batch, no per-image Python loop or
kernel launch. Each sample's parameters are given by the caller, so that they can be drawn per sample
from (seed, epoch, index) alone (``*_params`` draw them for n samples at once from a generator).

``random_crop_flip`` is torchvision's ``RandomCrop(size, padding=pad)`` (zero padding) followed by
``RandomHorizontalFlip``; ``resized_crop_params`` + ``resized_crop_flip`` are ``RandomResizedCrop(S,
scale=(0.08, 1), ratio=(3/4, 4/3))`` (Szegedy et al. 2015, section 6) + flip, the crop resampled
bilinearly without antialiasing (the crops of an S x S image are never larger than S: upsampling);
``erase_params`` + ``erase`` are ``RandomErasing(p, value=0)`` (Zhong et al. 2020) on normalised
images; ``normalize`` is ``ToDtype(float32, scale=True)`` followed by ``Normalize(mean, std)``;
``resize`` is ``Resize`` with antialiasing.
"""

from __future__ import annotations

import math
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
    # mirrored crops read right to left
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(c, device=x.device)[None, :, None, None]
    return xp[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]    # (N, C, H, W)


def _boxes(n: int, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
           generator: torch.Generator, tries: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``tries`` candidate boxes per sample, drawn as torchvision's ``RandomResizedCrop.get_params`` and
    ``RandomErasing.get_params`` draw theirs: area ``U(scale) * H * W``, aspect ``exp(U(log ratio))``,
    sides rounded. Returns (heights, widths), each (n, tries) int64; ``u`` for the position is drawn by
    the caller."""
    area = torch.rand(n, tries, generator=generator, dtype=torch.float64) * (scale[1] - scale[0]) + scale[0]
    log_r = torch.rand(n, tries, generator=generator, dtype=torch.float64) * math.log(ratio[1] / ratio[0]) \
        + math.log(ratio[0])
    area, aspect = area * height * width, torch.exp(log_r)
    return torch.sqrt(area / aspect).round().long(), torch.sqrt(area * aspect).round().long()


def _first_fit(ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the first True per row, whether any row entry is True) of ``ok`` (n, tries) bool."""
    first = torch.argmax(ok.to(torch.int8), dim=1)
    return first, ok.any(1)


def resized_crop_params(n: int, height: int, width: int, generator: torch.Generator,
                        scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """(boxes (n, 4) int64 = top, left, crop height, crop width; flips (n,) bool) of n samples of a
    ``height`` x ``width`` image, as ``RandomResizedCrop.get_params``: ten tries per sample, the first
    box that fits, else the whole image clamped to the ratio range and centred. On the CPU."""
    h, w = _boxes(n, height, width, scale, ratio, generator)
    u = torch.rand(n, 10, 2, generator=generator, dtype=torch.float64)
    first, fits = _first_fit((h > 0) & (h <= height) & (w > 0) & (w <= width))
    rows = torch.arange(n)
    h, w, u = h[rows, first], w[rows, first], u[rows, first]
    in_ratio = width / height
    fh, fw = (round(width / ratio[0]), width) if in_ratio < ratio[0] else \
        (height, round(height * ratio[1])) if in_ratio > ratio[1] else (height, width)
    h, w = torch.where(fits, h, fh), torch.where(fits, w, fw)
    top = torch.where(fits, (u[:, 0] * (height - h + 1)).long(), (height - h) // 2)
    left = torch.where(fits, (u[:, 1] * (width - w + 1)).long(), (width - w) // 2)
    flips = torch.rand(n, generator=generator) < 0.5
    return torch.stack([top, left, h, w], 1), flips


def resized_crop_flip(x: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """x (N, C, H, W) uint8 -> (N, C, H, W) uint8: sample ``i``'s box ``boxes[i]`` = (top, left, h, w)
    resampled to H x W as torchvision's ``resized_crop(antialias=False)`` does (bilinear, pixel centres
    as ``F.interpolate(align_corners=False)``, sample points clamped to the box), mirrored left-right
    where ``flips[i]``; one ``grid_sample`` for the batch. ``boxes`` (N, 4) and ``flips`` (N,) on x's
    device."""
    _, _, height, width = x.shape
    b = boxes.to(torch.float32)

    def axis(start: torch.Tensor, length: torch.Tensor, size: int) -> torch.Tensor:
        """(N, size) sample coordinates along one axis, normalised to [-1, 1] of the whole image."""
        centres = (torch.arange(size, device=x.device, dtype=torch.float32) + 0.5)
        pos = start[:, None] + (centres[None] * (length[:, None] / size) - 0.5).clamp_(min=0)
        pos = torch.minimum(pos, (start + length - 1)[:, None])
        return (2 * pos + 1) / size - 1

    ys, xs = axis(b[:, 0], b[:, 2], height), axis(b[:, 1], b[:, 3], width)
    xs = torch.where(flips[:, None], xs.flip(1), xs)
    grid = torch.stack(torch.broadcast_tensors(xs[:, None, :], ys[:, :, None]), dim=-1)   # (N, H, W, 2)
    out = F.grid_sample(x.to(torch.float32), grid, mode="bilinear", padding_mode="border",
                        align_corners=False)
    return out.round_().clamp_(0, 255).to(x.dtype)


def erase_params(n: int, height: int, width: int, p: float, generator: torch.Generator,
                 scale: tuple[float, float] = (0.02, 0.33),
                 ratio: tuple[float, float] = (0.3, 3.3)) -> torch.Tensor:
    """boxes (n, 4) int64 = top, left, height, width of each sample's erased rectangle (height 0: none),
    as ``RandomErasing(p, scale, ratio).get_params``: erased with probability ``p``, ten tries for a
    box strictly inside the image, none if no try fits. On the CPU."""
    on = torch.rand(n, generator=generator, dtype=torch.float64) < p
    h, w = _boxes(n, height, width, scale, ratio, generator)
    u = torch.rand(n, 10, 2, generator=generator, dtype=torch.float64)
    first, fits = _first_fit((h < height) & (w < width))
    rows = torch.arange(n)
    h, w, u = h[rows, first], w[rows, first], u[rows, first]
    keep = on & fits
    top, left = (u[:, 0] * (height - h + 1)).long(), (u[:, 1] * (width - w + 1)).long()
    return torch.where(keep[:, None], torch.stack([top, left, h, w], 1), 0)


def erase(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """x (N, C, H, W) with sample ``i``'s rectangle ``boxes[i]`` = (top, left, h, w) set to 0 in every
    channel (h = 0: unchanged); a new tensor. ``boxes`` (N, 4) on x's device."""
    _, _, height, width = x.shape
    r = torch.arange(height, device=x.device)
    c = torch.arange(width, device=x.device)
    in_r = (r >= boxes[:, :1]) & (r < boxes[:, :1] + boxes[:, 2:3])           # (N, H)
    in_c = (c >= boxes[:, 1:2]) & (c < boxes[:, 1:2] + boxes[:, 3:4])         # (N, W)
    return x.masked_fill((in_r[:, :, None] & in_c[:, None, :])[:, None], 0)


def normalize(x: torch.Tensor, mean: Union[Sequence[float], torch.Tensor],
              std: Union[Sequence[float], torch.Tensor], scale: float = 255.0) -> torch.Tensor:
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

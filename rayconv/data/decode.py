"""JPEG decode and augmentation for prepared shards, on the CPU (libjpeg-turbo) or the GPU (nvJPEG).

Training (``--augment``): ``resized-crop``: RandomResizedCrop (scale 0.08-1, aspect ratio 3/4-4/3, ten
tries then a center crop, as torchvision's; Szegedy et al. 2015, "Going deeper with convolutions",
section 6) to S x S, then a horizontal flip with probability 1/2; ``pad-crop``: the evaluation's
center crop, zero-padded by ``on_device.pad_for(S)``, randomly cropped back and flipped; ``none``:
the evaluation's center crop. Evaluation: the shorter side resized to S * 8 / 7, then a
center S x S crop. Both end with ImageNet's mean/std normalisation.

Exactness: a training sample's crop box and flip are drawn from a generator seeded only by
``stable_seed(seed, "train", epoch, index)`` and the stored image size, so they are the same on every
layout, loader worker count and decode device. The two decoders agree on which pixels are taken;
their pixel values may differ slightly (nvJPEG and libjpeg-turbo round their IDCTs differently).

All functions take and return uint8 images (3, H, W) until ``normalize``, which makes the model's
input: float (B, 3, S, S) of the requested dtype, channels_last on GPUs.
"""

from __future__ import annotations

import math
import random
from typing import Optional, Sequence

import torch
import torch.nn.functional as TF

from rayconv.data.on_device import pad_for

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def crop_params(height: int, width: int, seed: int, scale=(0.08, 1.0),
                ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int, bool]:
    """(top, left, crop height, crop width, flip) of one training sample, in pixels of an image of
    ``height`` x ``width``; depends only on the three arguments. The algorithm of torchvision's
    ``RandomResizedCrop.get_params``, drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return top, left, h, w, rng.random() < 0.5
    in_ratio = width / height  # fallback: the whole image, clamped to the ratio range, centred
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w, rng.random() < 0.5


def pad_crop_params(size: int, seed: int) -> tuple[int, int, bool]:
    """(row, column of the crop in the padded image, flip) of one pad-crop training sample of an S x S
    center crop (``size`` = S); depends only on the two arguments."""
    rng = random.Random(seed)
    pad = pad_for(size)
    return rng.randint(0, 2 * pad), rng.randint(0, 2 * pad), rng.random() < 0.5


def pad_crop(image: torch.Tensor, params: tuple[int, int, bool], size: int) -> torch.Tensor:
    """One pad-crop training sample: uint8 (3, H, W) -> uint8 (3, size, size): ``center``, zero-padded
    by ``pad_for(size)``, cropped at ``params`` (from ``pad_crop_params``) and flipped as they say."""
    pad = pad_for(size)
    top, left, flip = params
    out = TF.pad(center(image, size), (pad, pad, pad, pad))[:, top:top + size, left:left + size]
    return out.flip(-1) if flip else out


def augment(image: torch.Tensor, params: tuple[int, int, int, int, bool], size: int) -> torch.Tensor:
    """One training sample: uint8 (3, H, W) -> uint8 (3, size, size), cropped, resized (bilinear,
    antialiased) and flipped as ``params`` (from ``crop_params``) say. On the image's device."""
    from torchvision.transforms.v2 import functional as F

    top, left, h, w, flip = params
    out = F.resized_crop(image, top, left, h, w, [size, size], antialias=True)
    return F.horizontal_flip(out) if flip else out


def center(image: torch.Tensor, size: int) -> torch.Tensor:
    """One evaluation sample: uint8 (3, H, W) -> uint8 (3, size, size): shorter side to size * 8 // 7,
    then the center crop (as the imagefolder path's Resize + CenterCrop)."""
    from torchvision.transforms.v2 import functional as F

    return F.center_crop(F.resize(image, [size * 8 // 7], antialias=True), [size, size])


def decode(jpegs: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """JPEG bytes (1-D uint8 CPU tensors) -> RGB uint8 images (3, H, W) on ``device``: one batched
    nvJPEG call on a GPU (``torchvision.io.decode_jpeg`` with a list), libjpeg-turbo per image on the
    CPU. Raises RuntimeError for bytes that are not a JPEG."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if device.type == "cuda":
        return decode_jpeg(list(jpegs), mode=ImageReadMode.RGB, device=device)
    return [decode_jpeg(j, mode=ImageReadMode.RGB) for j in jpegs]


def transform(images: Sequence[torch.Tensor], size: int, params: Optional[Sequence[tuple]] = None,
              mode: str = "resized-crop") -> torch.Tensor:
    """Decoded images -> uint8 (B, 3, size, size): each sample's ``params`` applied by ``augment``
    (``mode`` resized-crop) or ``pad_crop`` (pad-crop); ``center`` when ``params`` is None (evaluation,
    and training under ``none``)."""
    if params is None:
        return torch.stack([center(img, size) for img in images])
    crop = pad_crop if mode == "pad-crop" else augment
    return torch.stack([crop(img, p, size) for img, p in zip(images, params)])


_MEAN_STD: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std as (1, 3, 1, 1) float32 tensors on ``device``, made once (no copy per batch)."""
    if device not in _MEAN_STD:
        _MEAN_STD[device] = (torch.tensor(MEAN, device=device).view(1, 3, 1, 1),
                             torch.tensor(STD, device=device).view(1, 3, 1, 1))
    return _MEAN_STD[device]


def normalize(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """uint8 (B, 3, S, S) -> the model's input: (x / 255 - mean) / std in float32, then ``dtype``
    (float32 when None); channels_last on GPUs. On ``x``'s device."""
    mean, std = _mean_std(x.device)
    out = (x.float().div_(255) - mean).div_(std)
    if dtype is not None:
        out = out.to(dtype)
    return out.contiguous(memory_format=torch.channels_last) if x.is_cuda else out

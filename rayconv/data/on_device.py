"""Small image sets held on the actor's device: the decoded uint8 images of both splits (Fashion-MNIST's
70,000 28x28 images are 55 MB) copied to the device once, on the first ``images`` call for it; each
batch is then an index, a batched crop and flip (training only) and a normalisation there, with no
host-to-device copy and no per-image work (``rayconv/data/augment.py``).

Augmentation: each training sample's crop offsets and flip come from one table of the whole train set
per epoch, drawn on the CPU from ``stable_seed(seed, "train", epoch)``, so that a sample's crop depends
only on (seed, epoch, sample index): not on the batch it is in, the data-parallel layout or the device.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from rayconv.data.augment import crop_flip_params, normalize, random_crop_flip, resize
from rayconv.data.source import Source, stable_seed


def channel_stats(x: np.ndarray) -> tuple[list[float], list[float]]:
    """(mean, std) per channel of uint8 images x (N, C, H, W), in [0, 1] units (pixel / 255), computed
    exactly from each channel's 256-bin histogram (no float copy of the images)."""
    means, stds = [], []
    values = np.arange(256, dtype=np.float64) / 255.0
    for c in range(x.shape[1]):
        pixels = torch.from_numpy(np.ascontiguousarray(x[:, c])).reshape(-1)
        p = torch.bincount(pixels, minlength=256).double().numpy()
        p /= p.sum()
        mean = float(p @ values)
        means.append(mean)
        stds.append(float(np.sqrt(p @ (values - mean) ** 2)))
    return means, stds


class OnDeviceSource(Source):
    """uint8 images (N, C, H, W) and int64 labels (N,) of a train and a test split, held on each device
    that asks for them.

    ``images`` returns float32 (or ``dtype``) (len(idx), C, S, S), S = ``image_size`` or H: normalised
    by ``mean`` / ``std`` (per channel, [0, 1] units; default: the train set's own); train samples
    zero-padded by ``pad`` pixels, randomly cropped back and randomly mirrored (``pad`` 0: no crop;
    ``flip`` False: no mirror); test samples as they are. With ``image_size`` other than H the images
    are resized once on the device to S x S (bilinear, antialiased) before any crop."""

    def __init__(self, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                 num_classes: int, seed: int, pad: int = 0, flip: bool = False,
                 image_size: Optional[int] = None, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None):
        self.host = {"train": torch.from_numpy(train[0]), "test": torch.from_numpy(test[0])}
        self.targets = {"train": torch.from_numpy(train[1]).long(), "test": torch.from_numpy(test[1]).long()}
        c, h, w = train[0].shape[1:]
        self.sample_shape = (c, h, w) if image_size is None else (c, image_size, image_size)
        self.num_classes = num_classes
        self.train_size, self.test_size = len(train[0]), len(test[0])
        self.seed, self.pad, self.flip = seed, pad, flip
        if mean is None or std is None:
            mean, std = channel_stats(train[0])
        self.mean, self.std = list(mean), list(std)
        self._stored: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._params: dict[torch.device, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Both splits' uint8 images on ``device`` (and the normalisation's mean and std), copied (and
        resized) on the first call."""
        stored = self._stored.get(device)
        if stored is None:
            stored = {"mean": torch.tensor(self.mean, dtype=torch.float32, device=device),
                      "std": torch.tensor(self.std, dtype=torch.float32, device=device)}
            for split, x in self.host.items():
                x = x.to(device)
                stored[split] = resize(x, self.sample_shape[1]) if x.shape[1:] != self.sample_shape else x
            self._stored[device] = stored
        return stored

    def _epoch_params(self, device: torch.device, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets (N, 2), flips (N,)) of every train sample in ``epoch``, on ``device``."""
        cached = self._params.get(device)
        if cached is None or cached[0] != epoch:
            g = torch.Generator().manual_seed(stable_seed(self.seed, "train", epoch))
            offsets, flips = crop_flip_params(self.train_size, self.pad, g)
            if not self.flip:
                flips.zero_()
            cached = self._params[device] = (epoch, offsets.to(device), flips.to(device))
        return cached[1], cached[2]

    def images(self, split, idx, device, epoch=0, dtype=None):
        dev = torch.device(device)
        rows = torch.as_tensor(np.asarray(idx), dtype=torch.long).to(dev)
        stored = self._on(dev)
        x = stored[split][rows]                                              # (n, C, S, S) uint8
        if split == "train" and (self.pad or self.flip):
            offsets, flips = self._epoch_params(dev, epoch)
            x = random_crop_flip(x, self.pad, offsets[rows], flips[rows])
        x = normalize(x, stored["mean"], stored["std"])                      # (n, C, S, S) float32
        return x if dtype is None else x.to(dtype)

    def labels(self, split, idx):
        return self.targets[split][torch.as_tensor(np.asarray(idx), dtype=torch.long)]

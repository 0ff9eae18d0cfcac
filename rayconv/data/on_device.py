"""Small image sets held on the actor's device: the decoded uint8 images of both splits (Fashion-MNIST's
70,000 28x28 images are 55 MB) copied to the device once, on the first ``images`` call for it; each
batch is then an index, a batched augmentation (training only), a normalisation and an optional
random erasing there, with no per-batch host-to-device copy and no per-image work
(``rayconv/data/augment.py``).

Augmentation (``augment``): ``pad-crop`` (zero-pad by ``pad`` pixels, random crop back, mirror: the
CIFAR recipe of He et al. 2016, section 4.2; ``pad`` by default ``pad_for(S)``), ``resized-crop``
(RandomResizedCrop + mirror), ``none``. Each training sample's parameters come from one table of the
whole train set per epoch, drawn on the CPU from ``stable_seed(seed, "train", epoch)`` (the erasing's
from ``stable_seed(seed, "erase", epoch)``) and copied to the device once per epoch, so that a
sample's augmentation depends only on (seed, epoch, sample index): not on the batch it is in, the
data-parallel layout or the device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

from rayconv.data import auto_augment as aa
from rayconv.data.augment import (crop_flip_params, erase, erase_params, normalize, random_crop_flip,
                                  resize, resized_crop_flip, resized_crop_params)
from rayconv.data.augment_graph import ReplayedAugment
from rayconv.data.source import Source, stable_seed, to_device
from rayconv.errors import ConfigError

AUGMENTS = ("pad-crop", "resized-crop", "none")


def pad_for(size: int) -> int:
    """The pad-crop's zero padding for S x S images: 4 pixels at 28-32 (CIFAR's and Fashion-MNIST's
    recipe), ``S // 8`` otherwise (at least 1)."""
    return 4 if 28 <= size <= 32 else max(1, size // 8)


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
    by ``mean`` / ``std`` (per channel, [0, 1] units; default: the train set's own). Training samples
    get ``augment`` (``AUGMENTS``; None: pad-crop by ``pad`` pixels and mirrored where ``flip``, nothing
    when both are off), then ``auto_augment``'s policy (``rayconv/data/auto_augment.py``), then with
    probability ``random_erase`` one rectangle set to 0 after the normalisation; test samples are as they are.
    With ``image_size`` other than H the images are resized once on the device to S x S (bilinear,
    antialiased) before any crop. Raises ConfigError for an unknown ``augment``."""

    def __init__(self, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                 num_classes: int, seed: int, pad: int = 0, flip: bool = False,
                 image_size: Optional[int] = None, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, augment: Optional[str] = None,
                 random_erase: float = 0.0, name: str = "data", auto_augment: Optional[str] = None):
        self.host = {"train": torch.from_numpy(train[0]), "test": torch.from_numpy(test[0])}
        self.targets = {"train": torch.from_numpy(train[1]).long(), "test": torch.from_numpy(test[1]).long()}
        c, h, w = train[0].shape[1:]
        self.sample_shape = (c, h, w) if image_size is None else (c, image_size, image_size)
        self.num_classes, self.name = num_classes, name
        self.train_size, self.test_size = len(train[0]), len(test[0])
        self.seed, self.random_erase = seed, random_erase
        self.augment, self.pad, self.flip, self.augmentation = augmentation_of(
            self.sample_shape[1], augment, pad, flip, random_erase, auto_augment)
        self.auto_augment = aa.make_transform(auto_augment) if auto_augment else None
        if mean is None or std is None:
            mean, std = channel_stats(train[0])
        self.mean, self.std = list(mean), list(std)
        self._stored: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._params: dict[torch.device, tuple[int, dict[str, torch.Tensor]]] = {}
        self._ahead: dict[int, Future] = {}   # epoch -> its table being drawn on self._pool
        self._pool: Optional[ThreadPoolExecutor] = None
        self._graphs: Optional[ReplayedAugment] = None

    def __getstate__(self) -> dict:
        """Picklable (a thread pool is not): the tables drawn ahead stay behind."""
        return {**self.__dict__, "_ahead": {}, "_pool": None, "_graphs": None}

    def load(self, device: torch.device) -> None:
        """Copy both splits onto ``device`` now (an actor's setup), rather than at its first step."""
        self._on(device)

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Both splits' uint8 images on ``device`` (and the normalisation's mean and std), copied (and
        resized) on the first call."""
        stored = self._stored.get(device)
        if stored is None:
            stored = {"mean": torch.tensor(self.mean, dtype=torch.float32, device=device),
                      "std": torch.tensor(self.std, dtype=torch.float32, device=device)}
            size = self.sample_shape[1]
            for split, x in self.host.items():
                if split == "val":   # (the train split's images, not a second copy)
                    stored[split] = stored["train"]
                    continue
                x = x.to(device)
                stored[split] = resize(x, size) if x.shape[2:] != (size, size) else x
            self._stored[device] = stored
        return stored

    def _epoch_params(self, device: torch.device, epoch: int) -> dict[str, torch.Tensor]:
        """Every train sample's augmentation in ``epoch``, on ``device``: ``offsets`` (N, 2) and ``flips``
        (N,) for pad-crop, ``boxes`` (N, 4) and ``flips`` for resized-crop, ``aa_groups`` (N,), ``erase``
        (N, 4) boxes. The next epoch's table is drawn on a background thread meanwhile (torch's CPU ops
        release the GIL), so that an epoch's first step does not wait for it."""
        cached = self._params.get(device)
        if cached is None or cached[0] != epoch:
            ahead = self._ahead.pop(epoch, None)
            params = ahead.result() if ahead is not None else self._draw_params(epoch)
            cached = self._params[device] = (epoch, {k: to_device(v, device) for k, v in params.items()})
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="rayconv-augment")
            self._ahead = {epoch + 1: self._pool.submit(self._draw_params, epoch + 1)}
        return cached[1]

    def _draw_params(self, epoch: int) -> dict[str, torch.Tensor]:
        """The augmentation table of ``epoch`` on the CPU (see ``_epoch_params``), from (seed, epoch)
        alone."""
        n, size = self.train_size, self.sample_shape[1]
        g = torch.Generator().manual_seed(stable_seed(self.seed, "train", epoch))
        params: dict[str, torch.Tensor] = {}
        if self.augment == "pad-crop":
            params["offsets"], params["flips"] = crop_flip_params(n, self.pad, g)
            if not self.flip:
                params["flips"].zero_()
        elif self.augment == "resized-crop":
            params["boxes"], params["flips"] = resized_crop_params(n, size, size, g)
        if self.auto_augment is not None:
            g_aa = torch.Generator().manual_seed(stable_seed(self.seed, "auto-augment", epoch))
            params["aa_groups"] = aa.group_params(n, g_aa)
        if self.random_erase > 0:
            g_erase = torch.Generator().manual_seed(stable_seed(self.seed, "erase", epoch))
            params["erase"] = erase_params(n, size, size, self.random_erase, g_erase)
        return params

    def images(self, split, idx, device, epoch=0, dtype=None):
        dev = torch.device(device)
        stored = self._on(dev)
        train = split == "train" and (self.augment != "none" or self.random_erase > 0
                                      or self.auto_augment is not None)
        params = self._epoch_params(dev, epoch) if train else {}
        held = {"images": stored[split], "mean": stored["mean"], "std": stored["std"]}
        rows = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        if dev.type == "cuda" and self.auto_augment is None:
            # (one graph replay a batch: augment_graph.py; the indices copied from pinned memory)
            x = self._replayed((split, train, dtype, None), held, rows=rows.pin_memory(), **params)
        else:
            x = self._augment((split, train, dtype, epoch), rows=to_device(rows, dev), **held, **params)
        return self.expand(x)

    def _augment(self, key: tuple, images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                 rows: torch.Tensor, **params: torch.Tensor) -> torch.Tensor:
        """The batch of samples ``rows`` (device int64 (n,)) of ``images`` (the split held on the
        device), augmented by the epoch's ``params`` (``_epoch_params``; none outside training) and
        normalised: float (n, C, S, S) of the key's dtype. ``key`` = (split, train, dtype, epoch; the
        epoch is read by auto-augment only)."""
        _, _, dtype, epoch = key
        x = images[rows]                                                     # (n, C, S, S) uint8
        if "offsets" in params and (self.pad or self.flip):
            x = random_crop_flip(x, self.pad, params["offsets"][rows], params["flips"][rows])
        elif "boxes" in params:
            x = resized_crop_flip(x, params["boxes"][rows], params["flips"][rows])
        if "aa_groups" in params:
            x = aa.apply(x, params["aa_groups"][rows], self.auto_augment, self.seed, epoch)
        x = normalize(x, mean, std)                                          # (n, C, S, S) float32
        if "erase" in params:
            x = erase(x, params["erase"][rows])
        return x if dtype is None else x.to(dtype)

    @property
    def _replayed(self) -> ReplayedAugment:
        """``_augment`` replayed as a CUDA graph per batch shape (made on first use; not pickled)."""
        if self._graphs is None:
            self._graphs = ReplayedAugment(self._augment)
        return self._graphs

    def labels(self, split, idx):
        return self.targets[split][torch.as_tensor(np.asarray(idx), dtype=torch.long)]

    def add_val_split(self) -> None:
        self.host["val"], self.targets["val"] = self.host["train"], self.targets["train"]   # (not augmented)


def augmentation_of(side: int, augment: Optional[str], pad: int = 0, flip: bool = False,
                    random_erase: float = 0.0,
                    auto_augment: Optional[str] = None) -> tuple[str, int, bool, str]:
    """(augment, pad, flip, in words) of ``OnDeviceSource``'s training samples of ``side`` pixels given
    its arguments (None: pad-crop by ``pad`` and mirrored where ``flip``, nothing when both are off;
    pad-crop: by ``pad`` or ``pad_for(side)``, mirrored). Raises ConfigError for an unknown ``augment``."""
    if augment is None:
        augment = "pad-crop" if pad or flip else "none"
    elif augment == "pad-crop":
        pad, flip = pad or pad_for(side), True
    if augment not in AUGMENTS:
        raise ConfigError(f"unknown --augment {augment!r}: choose one of {', '.join(AUGMENTS)}")
    pad, flip = (pad, flip) if augment == "pad-crop" else (0, augment == "resized-crop")
    return augment, pad, flip, augment_words(augment, pad, flip, random_erase, auto_augment)


def augment_words(augment: str, pad: int, flip: bool, random_erase: float,
                  auto_augment: Optional[str]) -> str:
    """The augmentation in words, for ``Source.describe``."""
    text = {"pad-crop": f"pad {pad} + random crop" + (" + flip" if flip else ""),
            "resized-crop": "RandomResizedCrop(0.08-1) + flip", "none": "none"}[augment]
    if augment == "pad-crop" and not pad:
        text = "flip" if flip else "none"
    text += f", auto-augment {auto_augment} (batched in {aa.GROUPS} groups)" if auto_augment else ""
    return text + (f", random erasing p={random_erase:g}" if random_erase > 0 else "") + " (on the device)"

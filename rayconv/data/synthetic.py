"""``--data synthetic``: ImageNet-shaped images (3 x S x S, ``num_classes`` classes) made directly on the
device, for throughput; labels are a fixed function of the sample index."""

from __future__ import annotations

import numpy as np
import torch

from rayconv.data.source import Source, stable_seed


class SyntheticSource(Source):
    """ImageNet-shaped synthetic data generated on the device (no host-to-device copy).

    A batch's values depend on (seed, split, epoch, first index, batch length), not on each sample alone:
    the data carry no signal to learn, only shapes and bytes to move."""

    def __init__(self, image_size: int, num_classes: int, train_size: int, seed: int):
        self.sample_shape = (3, image_size, image_size)
        self.num_classes = num_classes
        self.train_size, self.test_size = train_size, max(1, train_size // 8)
        self.seed = seed
        self._gens: dict[torch.device, torch.Generator] = {}

    def images(self, split, idx, device, epoch=0, dtype=None):
        dev = torch.device(device)
        g = self._gens.get(dev)
        if g is None:
            g = self._gens[dev] = torch.Generator(device=dev)
        first = int(idx[0]) if len(idx) else 0
        g.manual_seed(stable_seed(self.seed, split, epoch, first, len(idx)))
        # Made in the layout the model runs in (channels_last on GPUs), so no conversion copy follows.
        fmt = torch.channels_last if dev.type == "cuda" else torch.contiguous_format
        # Made directly in ``dtype`` (bf16 under bf16 autocast: half the bytes to write, no cast after).
        return torch.empty((len(idx), *self.sample_shape), device=dev, memory_format=fmt,
                           dtype=dtype or torch.float32).normal_(generator=g)

    def add_val_split(self) -> None:
        """Nothing to hold: "val" images are made as any others, its labels are the train split's."""

    def labels(self, split, idx):
        offset = 0 if split in ("train", "val") else 7
        return torch.as_tensor((np.asarray(idx, dtype=np.int64) * 7919 + offset) % self.num_classes)

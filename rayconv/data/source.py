"""The data interface every source implements, and the deterministic sharding of each global batch over
data-parallel replicas.

Sharding: the train set is ordered once per epoch from (seed, epoch) (``data.order``: one permutation
of all samples, or ``--shuffle block``'s windows of shards); global step ``s`` of the epoch
takes the next ``global_batch_size`` samples (the last batch of an epoch may be smaller); replica ``r``
takes its contiguous slice of that batch, slices as even as possible (sizes differ by at most 1).
With ``--val-split F`` the validation images (``floor(F x train_size)`` of the train split, drawn from
the seed alone: ``val_indices``) are left out of every epoch's order, so an epoch is the rest.
Every actor computes the same indices alone, so data never passes through the driver. Gradients are
weighted by sample count (loss summed over samples and divided by the global count), so uneven
slices stay exact.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import TensorDataset

from rayconv.data.order import BlockOrder, ExactOrder
from rayconv.errors import ConfigError
from rayconv.mesh import split_slices


def stable_seed(*parts: object) -> int:
    """A 31-bit seed from ints and strings, the same in every process (unlike ``hash`` of a str)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


@dataclass(frozen=True)
class Sharding:
    """Which train samples each replica reads at each step.

    ``train_size`` samples in the source's train split, ``global_batch_size`` per step, split over the
    mesh's ``dp`` replicas (``replica_batch``: dp is the mesh's, passed in, not held here);
    ``steps_per_epoch`` counts the last partial batch. ``order``: the epoch order
    (``data.order.make_order``); None: ExactOrder. ``val_split``: the fraction of the train split held
    out for validation (``val_indices``), never in a training batch.
    """

    train_size: int
    global_batch_size: int
    seed: int
    order: Optional[BlockOrder] = None
    val_split: float = 0.0

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.train_samples // self.global_batch_size)

    @property
    def train_samples(self) -> int:
        """Samples an epoch trains on: the train split less the validation images."""
        return self.train_size - len(self.val_indices())

    def val_indices(self) -> np.ndarray:
        """The validation images' indices in the train split, sorted, int64: ``floor(val_split x
        train_size)`` of them, from numpy's PCG64 seeded by [seed, 0x7A1] alone (the same in every
        layout and on resume). Raises ConfigError when a nonzero ``val_split`` holds out no image."""
        cached = self.__dict__.get("_val")
        if cached is None:
            n = int(self.val_split * self.train_size)
            if self.val_split > 0 and n == 0:
                raise ConfigError(
                    f"--val-split {self.val_split:g} holds out no image of the {self.train_size} "
                    f"train images: raise it to >= {1 / self.train_size:.2g} or drop it")
            perm = (
                np.random.default_rng([self.seed, 0x7A1]).permutation(self.train_size) if n else np.zeros(0)
            )
            cached = np.sort(perm[:n]).astype(np.int64)
            object.__setattr__(self, "_val", cached)
        return cached

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The epoch's sample order (computed once per epoch: ImageNet's is 1.28 M long): indices into
        the train split, the validation images left out."""
        cached = self.__dict__.get("_perm")
        if cached is None or cached[0] != epoch:
            held = self.val_indices()
            if self.order is not None:
                assert self.order.size == self.train_size, "the order was made for another train set"
                perm = self.order.epoch_order(epoch)
                if len(held):   # (a window's samples stay contiguous)
                    perm = perm[~np.isin(perm, held, assume_unique=True)]
            else:
                perm = ExactOrder(self.train_size - len(held), self.seed).epoch_order(epoch)
                if len(held):
                    perm = np.delete(np.arange(self.train_size), held)[perm]
            cached = (epoch, perm)
            object.__setattr__(self, "_perm", cached)
        return cached[1]

    def global_batch(self, epoch: int, step_in_epoch: int) -> np.ndarray:
        """Sample indices of the whole global batch, shape (B,), B <= global_batch_size."""
        start = step_in_epoch * self.global_batch_size
        return self.epoch_permutation(epoch)[start:start + self.global_batch_size]

    def replica_batch(self, epoch: int, step_in_epoch: int, replica: int, dp: int) -> tuple[np.ndarray, int]:
        """(replica ``replica``'s sample indices of the global batch split over ``dp`` replicas (the mesh's),
        number of samples in the global batch)."""
        batch = self.global_batch(epoch, step_in_epoch)
        return batch[split_slices(len(batch), dp)[replica]], len(batch)


def replica_val_indices(val: np.ndarray, dp: int, replica: int) -> np.ndarray:
    """The validation indices (``Sharding.val_indices``) evaluated by ``replica``: each once over all."""
    return val[split_slices(len(val), dp)[replica]]


def replica_test_indices(test_size: int, dp: int, replica: int) -> np.ndarray:
    """Held-out indices evaluated by ``replica``: every sample exactly once over all replicas."""
    return np.arange(test_size)[split_slices(test_size, dp)[replica]]


class Source:
    """Train and test data of one kind, as seen by one actor.

    ``num_classes``; ``sample_shape`` (C, H, W) as the model sees it; ``train_size`` and ``test_size``
    in samples. ``images(split, idx, device, epoch, dtype)`` -> float tensor (len(idx), C, H, W) of
    ``dtype`` (float32 when None); ``labels(split, idx)`` -> int64 (len(idx),). ``describe()``: one line
    saying what the source gives (the driver prints it). ``set_channels(3)`` on grey data makes
    ``images`` return each grey image as 3 equal channels (a view); a source's ``images`` applies it
    with ``expand``.
    """

    num_classes: int
    sample_shape: tuple[int, int, int]
    train_size: int
    test_size: int
    name: str = "data"
    augmentation: str = "none"   # what training samples get, in words (describe's)
    expanded_from: Optional[int] = None   # the data's own channels where set_channels changed them

    def set_channels(self, channels: Optional[int]) -> None:
        """Give the model ``channels`` (1 or 3; None: the data's own). Grey data asked for 3 is expanded
        (``expand``); other changes raise ConfigError naming --channels."""
        own = self.expanded_from or self.sample_shape[0]
        if channels is None or channels == own:
            self.sample_shape, self.expanded_from = (own, *self.sample_shape[1:]), None
            return
        if own != 1 or channels != 3:
            raise ConfigError(f"--channels {channels}: --data {self.name} has {own}-channel images, and only "
                              "grey images can be given as 3 channels: drop --channels or set it to "
                              f"{own}")
        self.sample_shape, self.expanded_from = (3, *self.sample_shape[1:]), 1

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, C, H, W) as the model's channels: grey x expanded to 3 equal channels (a view) after
        ``set_channels(3)``, else x itself."""
        return x.expand(-1, self.sample_shape[0], -1, -1) if self.expanded_from else x

    def describe(self) -> str:
        """One line: name, sizes, image shape, classes, training augmentation, channel expansion."""
        c, h, w = self.sample_shape
        text = (f"{self.name}: {self.train_size} train / {self.test_size} test images, {h}x{w}, "
                f"{self.num_classes} classes; training augmentation: {self.augmentation}")
        if self.expanded_from:
            text += f"; grey images given to the model as {c} equal channels (expand, a view)"
        return text

    def images(self, split: str, idx: np.ndarray, device: torch.device, epoch: int = 0,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError

    def labels(self, split: str, idx: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def device_labels(self, split: str, idx: np.ndarray, device: torch.device) -> Optional[torch.Tensor]:
        """The labels of samples ``idx`` already on ``device``, int64 (len(idx),), when the last
        ``images`` call, for the same samples, copied them there with its pixels (one copy from the
        buffer its reader filled, queued with the pixels'); else None: ``labels`` gives them."""
        return None

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Announce the batches ``images`` will be asked for next (sources that decode files start now)."""

    def add_val_split(self) -> None:
        """Make split ``"val"`` name the train split's samples, read as the test split's are (no
        augmentation; the evaluation crop): ``--val-split``'s images (``Sharding.val_indices``) are
        evaluated through it."""
        raise NotImplementedError


class TensorSource(Source):
    """A data set held in host memory as float tensors (digits), indexed per batch and copied to the
    device."""

    def __init__(self, train: TensorDataset, test: TensorDataset, num_classes: int, name: str = "data"):
        self.sets = {"train": train, "test": test}
        self.num_classes = num_classes
        self.sample_shape = tuple(train.tensors[0].shape[1:])  # type: ignore[assignment]
        self.train_size, self.test_size = len(train), len(test)
        self.name = name

    def images(self, split, idx, device, epoch=0, dtype=None):
        x = self.sets[split].tensors[0][torch.as_tensor(idx, dtype=torch.long)]
        x = x.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else x
        return self.expand(x if dtype is None else x.to(dtype))

    def labels(self, split, idx):
        return self.sets[split].tensors[1][torch.as_tensor(idx, dtype=torch.long)]

    def add_val_split(self) -> None:
        self.sets["val"] = self.sets["train"]   # (held tensors are not augmented)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without a stream synchronisation (a copy from pageable memory would
    wait for all queued work first): through pinned memory, asynchronously."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

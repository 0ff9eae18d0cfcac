"""Small image folders and shard folders held on the device (``--data-on-device``).

``--data imagefolder`` and ``--data shards`` decode each batch in the loader's processes; on small
images (28-64 pixels) that decode, not the model, sets the step time. When the data is held on the
device, every image of both splits is decoded once, to exactly the image the loader path gives before
its augmentation (its evaluation crop: for an image folder torchvision's ``Resize(S * 8 // 7)`` +
``CenterCrop(S)`` of the PIL image, ``imagefolder.center_transforms``; for shards libjpeg-turbo's decode
then ``decode.center``; for raw-pixel shards the stored pixels through ``decode.center``), as uint8
(N, 3, S, S), by ``registry.decode_workers`` processes (a DataLoader over blocks of ``DECODE_BLOCK``
images). The images go to each actor's device as ``OnDeviceSource`` holds them: batches are augmented
there by batched tensor operations from per-epoch tables drawn from (seed, epoch, index), normalised by
ImageNet's mean and std as the loader path is.

Rule (``held_on_device``): ``on`` holds the data (refused with ``--augment resized-crop``, whose crop
needs each image's own size); ``off`` keeps the loader; ``auto`` holds it when the augmentation is
pad-crop or none and both splits as uint8 take at most ``hold_limit``: ``SMALL_DATA_BYTES``, and
1/``HOLD_SHARE`` of the memory each actor's copy shares (each CPU actor holds its own copy in its
node's memory, so that memory is divided among the actors on the node; on GPUs the device's free
memory). Before Ray starts only ``SMALL_DATA_BYTES`` is known; the driver then resolves ``auto`` to
on or off against the cluster (``decide_auto``, in ``driver/resolve.py``), so every actor does the
same. The decode runs in the
actor's build (``HeldSource.hold``, before the first step, reported apart: the console line "decoded N
images in S s on W workers" and summary.json's ``startup``), or on the first ``images`` call of a
process that did not call ``hold`` (a single-device reference); not where the source is only built to
check the run (the driver).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from rayconv.choices import DATA_ON_DEVICE_CHOICES, HOLD_SHARE, SMALL_DATA_BYTES  # noqa: F401 (read here)
from rayconv.config import Config
from rayconv.data import decode as dec
from rayconv.data.folders import SPLITS
from rayconv.data.imagefolder import CheckedImageFolder, center_transforms
from rayconv.data.on_device import OnDeviceSource
from rayconv.data.raw_shards import RawCenters, RawShardSource
from rayconv.data.shards import ShardSource
from rayconv.data.source import Source
from rayconv.errors import ConfigError, DataError

DECODE_BLOCK = 256           # images decoded per task of the decode processes
CPU = torch.device("cpu")


def held_on_device(cfg: Config, images: int) -> bool:
    """Whether ``images`` (both splits) of ``cfg.data`` at ``cfg.data_image_size`` are held on the
    device (the module's rule; ``on`` with the resized crop is refused by ``Config.validate``). Raises
    ConfigError (one line) for an unknown ``--data-on-device``."""
    mode, augment = cfg.data_on_device, cfg.augmentation
    if mode not in DATA_ON_DEVICE_CHOICES:
        raise ConfigError(f"unknown --data-on-device {mode!r}: choose one of "
                          f"{', '.join(DATA_ON_DEVICE_CHOICES)}")
    if mode != "auto":
        return mode == "on"
    return augment in ("pad-crop", "none") and held_bytes(cfg, images) <= SMALL_DATA_BYTES


def held_bytes(cfg: Config, images: int) -> int:
    """Bytes of ``images`` held as uint8 (N x 3 x S x S) at ``cfg.data_image_size``."""
    return images * 3 * cfg.data_image_size ** 2


def hold_limit(memory_bytes: int, actors: int) -> int:
    """Bytes ``--data-on-device auto`` holds per actor: ``SMALL_DATA_BYTES``, and at most 1/``HOLD_SHARE``
    of ``memory_bytes`` divided among the ``actors`` holding a copy in it (a node's memory and its
    CPU actors; a GPU's free memory and its one actor)."""
    return min(SMALL_DATA_BYTES, memory_bytes // (HOLD_SHARE * max(1, actors)))


def decide_auto(data_bytes: int, memory_bytes: int, actors: int, memory: str) -> tuple[bool, str]:
    """(hold, why) for ``data_bytes`` of decoded images per actor under ``hold_limit(memory_bytes,
    actors)``; ``memory`` names it ("the node's memory", "GPU 0's free memory"): the console's reason."""
    limit = hold_limit(memory_bytes, actors)
    held = data_bytes <= limit
    return held, (f"{data_bytes / 2**20:.1f} MB of decoded images per actor {'<=' if held else '>'} "
                  f"{limit / 2**20:.1f} MB, the smaller of {SMALL_DATA_BYTES / 2**30:g} GiB and "
                  f"1/{HOLD_SHARE} of {memory} ({memory_bytes / 2**30:.1f} GiB) / {actors} "
                  f"actor{'s' * (actors != 1)} holding a copy")


def maybe_hold(cfg: Config, loader: Source, workers: int) -> Source:
    """``loader`` (an ImageFolderSource or ShardSource, built and checked) or, when ``held_on_device``,
    a ``HeldSource`` of the same images. Raises ConfigError as ``held_on_device``."""
    if not held_on_device(cfg, loader.train_size + loader.test_size):
        return loader
    center = RawCenters(loader) if isinstance(loader, RawShardSource) else _ShardCenters(loader) \
        if isinstance(loader, ShardSource) else _FolderCenters(Path(cfg.data_dir or ""), cfg.data_image_size,
                                                               getattr(loader, "sets", None))
    return HeldSource(loader, center, workers, cfg)


def is_held(source: Source) -> bool:
    """Whether ``source`` is (or, for ``ManifestSource``, describes) data held on the device."""
    return isinstance(source, HeldSource) or bool(getattr(source, "held", False))


def held_words(raw: bool, nbytes: int) -> str:
    """What ``HeldSource.augmentation`` adds: the data held, ``nbytes`` of uint8 images read (``raw``
    pixels) or decoded once."""
    return (f"; data held on the device (--data-on-device): both splits {'read' if raw else 'decoded'} "
            f"once, {nbytes / 2**20:.1f} MB of uint8 images")


class HeldSource(OnDeviceSource):
    """An image folder's or a shard folder's images held on the device (``OnDeviceSource``): uint8
    (N, 3, S, S) buffers of both splits, filled by ``center`` in ``workers`` processes on the first
    ``_on`` call, labels and classes taken from ``loader``, ImageNet's normalisation, ``cfg``'s
    augment, random erasing, auto-augment policy and seed. A shard folder's ``manifest`` is kept, so
    that ``--shuffle block`` orders the samples as the loader path does."""

    def __init__(self, loader: Source, center: Callable, workers: int, cfg: Config):
        s = loader.sample_shape[1]
        arrays = {split: (np.empty((n, 3, s, s), dtype=np.uint8), loader.labels(split, np.arange(n)).numpy())
                  for split, n in (("train", loader.train_size), ("test", loader.test_size))}
        super().__init__(arrays["train"], arrays["test"], num_classes=loader.num_classes, seed=cfg.seed,
                         mean=dec.MEAN, std=dec.STD, augment=cfg.augmentation, random_erase=cfg.random_erase,
                         name=loader.name, auto_augment=cfg.auto_augment)
        self.buffers = {split: a[0] for split, a in arrays.items()}
        self.center, self.workers, self.decoded = center, workers, False
        if hasattr(loader, "manifest"):
            self.manifest = loader.manifest
        nbytes = sum(b.nbytes for b in self.buffers.values())
        self.augmentation += held_words(isinstance(center, RawCenters), nbytes)

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.decoded:
            decode_into(self.buffers, self.center, self.workers)
            self.decoded = True
        return super()._on(device)

    def hold(self, device: torch.device) -> dict[str, Any]:
        """Decode both splits and copy them to ``device`` now (the actor's setup calls it, so that the
        decode is not inside the first timed step); returns {"images", "workers", "decode_s"} (seconds
        of the decode, the device copy included)."""
        t0 = time.perf_counter()
        self._on(torch.device(device))
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return {"images": self.train_size + self.test_size, "workers": self.workers,
                "decode_s": time.perf_counter() - t0}


def decode_into(buffers: dict[str, np.ndarray], center: Callable, workers: int) -> None:
    """Fill each split's buffer (N, 3, S, S) uint8 of ``buffers`` with ``center(split, idx)`` of every
    sample, ``DECODE_BLOCK`` at a time, all splits in one pool of ``workers`` forked processes (started once;
    in this process for 0). Raises DataError naming the file that does not decode."""
    for split in buffers:
        center.open(split)   # (before the fork: the workers share what it lists)
    blocks = _DecodeBlocks(center, {split: len(b) for split, b in buffers.items()})
    loader = DataLoader(blocks, batch_size=None, num_workers=workers, generator=torch.Generator(),
                        multiprocessing_context="fork" if workers else None,
                        prefetch_factor=2 if workers else None)
    it, failed = iter(loader), None
    for split, k in blocks.items:
        try:
            x = next(it)
        except (RuntimeError, DataError) as e:   # a worker's error comes back with its traceback
            lines = str(e).strip().splitlines() or [repr(e)]
            named = [line for line in lines if "DataError: " in line] or lines[-1:]
            failed = named[-1].split("DataError: ", 1)[-1]
            e.__traceback__ = None   # (its frames hold the iterator, in a cycle through the exception)
            break
        buffers[split][k * DECODE_BLOCK:k * DECODE_BLOCK + len(x)] = x.numpy()
    # The iterator's last reference: its workers stop now. Held by the worker error's frames, they would
    # stop at a later garbage collection, which may finalise their index queues first and then wait
    # MP_STATUS_CHECK_INTERVAL (5 s) per worker for workers that never got the stop.
    del it
    if failed is not None:
        raise DataError(failed)


class _DecodeBlocks(Dataset):
    """Item j: the j-th (split, k) of ``items``: samples k * DECODE_BLOCK ... of that split as
    ``center`` makes them, uint8 (n, 3, S, S); ``sizes``: each split's sample count."""

    def __init__(self, center: Callable, sizes: dict[str, int]):
        self.center, self.sizes = center, sizes
        self.items = [(split, k) for split, n in sizes.items() for k in range(-(-n // DECODE_BLOCK))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, j: int) -> torch.Tensor:
        split, k = self.items[j]
        return self.center(split, np.arange(k * DECODE_BLOCK, min(self.sizes[split], (k + 1) * DECODE_BLOCK)))


class _ShardCenters:
    """A shard folder's evaluation images: the JPEG bytes (checked shards) decoded by libjpeg-turbo
    and center-cropped as ``ShardSource``'s loader path does (``decode.transform`` without params)."""

    def __init__(self, source: ShardSource):
        self.source = source

    def open(self, split: str) -> None:
        """Nothing to list: the shards were opened and checked with the source."""

    def __call__(self, split: str, idx: np.ndarray) -> torch.Tensor:
        try:
            return dec.transform(dec.decode(self.source.jpegs(split, idx), CPU), self.source.size)
        except RuntimeError as e:   # libjpeg-turbo's error on bytes of a shard that passed its checks
            raise DataError(f"cannot decode a sample of {self.source.root} ({e}): prepare the folder again") \
                from None


class _FolderCenters:
    """An image folder's evaluation images: torchvision's ImageFolder (the loader path's file list and
    RGB conversion) through ``center_transforms``, as uint8 (n, 3, S, S). Each split's file list is the
    loader's (``listing``: its split -> CheckedImageFolder, listed where it was built) or, without one,
    listed by ``open`` in the process that decodes (not where the source is only built). The resize and
    crop are PIL's own calls, as ``center_transforms`` makes them of a PIL image (without torchvision's
    per-call dispatch); each new image size is checked once against ``center_transforms`` and, should
    they differ, read through it."""

    def __init__(self, root: Path, size: int, listing: Optional[dict[str, CheckedImageFolder]] = None):
        self.root, self.size = root, size
        self.listing = listing
        self.sets: dict[str, CheckedImageFolder] = {}
        self.transform: Optional[Callable] = None
        # image (width, height) -> PIL's calls equal the transform's
        self.same: dict[tuple[int, int], bool] = {}

    def open(self, split: str) -> None:
        """List ``split``'s folder (once), or take the loader's list of it."""
        if split not in self.sets:
            # (torchvision's import takes seconds: only when used)
            from torchvision.transforms import v2 as T

            self.transform = T.Compose(center_transforms(self.size))
            if self.listing is not None and split in self.listing:
                folder = copy.copy(self.listing[split])
                folder.inner = copy.copy(folder.inner)
                folder.inner.transform = None   # (the PIL image: ``_center`` crops it)
                self.sets[split] = folder
            else:
                self.sets[split] = CheckedImageFolder(self.root / SPLITS[split], None)

    def _center(self, image) -> np.ndarray:
        """A PIL RGB image -> uint8 (S, S, 3): shorter side to S * 8 // 7 (PIL's antialiased bilinear
        resize, the longer side truncated as torchvision computes it), then the center S x S."""
        from PIL import Image

        w, h, s, short = *image.size, self.size, self.size * 8 // 7
        nw, nh = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
        top, left = int(round((nh - s) / 2.0)), int(round((nw - s) / 2.0))
        out = np.asarray(image.resize((nw, nh), Image.BILINEAR).crop((left, top, left + s, top + s)))
        same = self.same.get((w, h))
        if same is None:
            same = self.same[(w, h)] = np.array_equal(out, np.asarray(self.transform(image)))
        return out if same else np.asarray(self.transform(image))

    def __call__(self, split: str, idx: np.ndarray) -> torch.Tensor:
        self.open(split)
        out = np.empty((len(idx), self.size, self.size, 3), np.uint8)   # (each image's bytes, HWC)
        for k, i in enumerate(idx):
            out[k] = self._center(self.sets[split].load(int(i))[0])
        return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()

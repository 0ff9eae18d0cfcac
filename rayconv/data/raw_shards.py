"""Raw-pixel shards (``python -m rayconv.prepare --encoding raw``, format ``rayconv-shards/3``) as a
training source: ``--data shards`` on such a folder.

Nothing is decoded. A batch is gathered from the memory-mapped shards by numpy fancy indexing (one
gather per shard it touches, no per-image Python) into a (B, S, S, 3) uint8 tensor (pinned on GPU
nodes), read ahead on a thread of its own (``READ_AHEAD`` batches, numpy releases the GIL while it
copies; their pages asked of the kernel first, ``OpenShard.will_need``), copied to the device and
augmented there by batched tensor operations. NHWC bytes seen as NCHW (a permuted view) are already
channels_last, the layout the model takes on GPUs.

Augmentation, from per-epoch tables of the whole train set drawn from (seed, epoch) alone (the tables
of ``OnDeviceSource``, so that a raw folder streamed and held on the device, ``--data-on-device``,
gives the same batches): ``pad-crop`` and ``none`` start from the evaluation's center crop
(``decode.center``: shorter side to S * 8 // 7, center S x S), as JPEG shards and held data do;
``resized-crop`` crops the stored image (resized to S x S first when the prepare size is not S).
Memory: as ``ShardSource`` (the mappings are shared page cache); the checks of a shard that
disappears or changes are the same (``OpenShard.check``, before a batch's bytes are read).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rayconv.data import auto_augment as aa
from rayconv.data import decode as dec
from rayconv.data.augment import erase, random_crop_flip, resize, resized_crop_flip
from rayconv.data.folders import SPLITS
from rayconv.data.on_device import OnDeviceSource, _words, pad_for
from rayconv.data.shard_files import OpenShard, encoding, read_manifest
from rayconv.data.source import Source, to_device
from rayconv.errors import ConfigError, DataError

READ_AHEAD = 8   # batches gathered ahead of their use


class RawShardSource(Source):
    """A raw-pixel shard folder (``root``): labels read at open, pixels gathered per batch.

    ``images`` -> float (len(idx), 3, S, S) of ``dtype``, S = ``image_size``, normalised by ImageNet's
    mean and std (as JPEG shards). ``uint8(split, idx)`` -> the stored pixels, uint8 (len(idx), P, P, 3),
    P the prepare size. Raises DataError for a folder whose manifest does not match its files or that
    holds JPEGs; ConfigError for an unknown ``augment``."""

    def __init__(self, root: str, image_size: int, seed: int, augment: str = "pad-crop",
                 random_erase: float = 0.0, auto_augment: Optional[str] = None):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        if encoding(self.manifest) != "raw":
            raise DataError(f"{self.root} holds JPEG shards, not raw pixels: read it with ShardSource")
        if augment not in ("pad-crop", "resized-crop", "none"):
            raise ConfigError(f"unknown --augment {augment!r}: choose one of pad-crop, resized-crop, none")
        self.stored = int(self.manifest["image_shape"][0])
        self.classes = list(self.manifest["classes"])
        self.num_classes, self.name = len(self.classes), "shards"
        self.sample_shape = (3, image_size, image_size)
        self.seed, self.augment, self.random_erase = seed, augment, random_erase
        self.auto_augment = aa.make_transform(auto_augment) if auto_augment else None
        # The attributes OnDeviceSource's per-epoch tables read (its _epoch_params / _draw_params).
        self.pad, self.flip = (pad_for(image_size), True) if augment == "pad-crop" else (0, augment == "resized-crop")
        self._params: dict = {}
        self._ahead: dict[int, Future] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self.augmentation = _words(augment, self.pad, self.flip, random_erase, auto_augment).replace(
            " (on the device)", f" (raw pixels {self.stored}x{self.stored}, no decode)")
        self.shards: dict[str, list[OpenShard]] = {}
        self.starts: dict[str, np.ndarray] = {}
        self.targets: dict[str, torch.Tensor] = {}
        for split, folder in SPLITS.items():
            entries = self.manifest["splits"][folder]["shards"]
            self.shards[split] = [OpenShard(self.root / e["file"], int(e["rows"])) for e in entries]
            labels = [sh.columns(["label"])["label"] for sh in self.shards[split]]
            self.targets[split] = torch.from_numpy(np.concatenate(labels).astype(np.int64) if labels
                                                   else np.zeros(0, np.int64))
            self.starts[split] = np.cumsum([0] + [sh.rows for sh in self.shards[split]])
        self.train_size, self.test_size = len(self.targets["train"]), len(self.targets["test"])
        if self.train_size == 0 or self.test_size == 0:
            raise DataError(f"{self.root} holds {self.train_size} train and {self.test_size} val images: "
                            "both splits need images")
        self._pending: dict[str, deque] = {}
        self._reader: Optional[ThreadPoolExecutor] = None

    _epoch_params = OnDeviceSource._epoch_params
    _draw_params = OnDeviceSource._draw_params

    # ------------------------------------------------------------------ bytes
    def _locate(self, split: str, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        starts = self.starts[split]
        shard = np.searchsorted(starts, idx, side="right") - 1
        return shard, np.asarray(idx, dtype=np.int64) - starts[shard]

    def _groups(self, split: str, idx: np.ndarray):
        """(shard, positions in ``idx``, rows in that shard) of each shard that samples ``idx`` touch,
        grouped by one stable argsort (no per-sample Python)."""
        shard, row = self._locate(split, idx)
        order = np.argsort(shard, kind="stable")
        sorted_shards = shard[order]
        firsts = np.flatnonzero(np.r_[True, sorted_shards[1:] != sorted_shards[:-1]])
        for a, b in zip(firsts.tolist(), np.r_[firsts[1:], len(order)].tolist()):
            yield int(sorted_shards[a]), order[a:b], row[order[a:b]]

    def uint8(self, split: str, idx: np.ndarray, pin: bool = False) -> torch.Tensor:
        """The stored pixels of samples ``idx``: uint8 (len(idx), P, P, 3), in pinned memory with
        ``pin``. The shards they touch are checked first (DataError naming one that changed)."""
        idx = np.asarray(idx, dtype=np.int64)
        p = self.stored
        out = torch.empty((len(idx), p, p, 3), dtype=torch.uint8, pin_memory=pin)
        flat = out.numpy().reshape(len(idx), p * p * 3)
        for s, positions, rows in self._groups(split, idx):
            sh = self.shards[split][s]
            sh.check()
            flat[positions] = sh.pixels(rows)
        return out

    def read_ahead(self, split: str, idx: np.ndarray) -> None:
        """Ask the kernel to read the pixel bytes of samples ``idx`` from disk now (``madvise(WILLNEED)``
        on the shards' mappings: returns at once, the reads go on in the background)."""
        for s, _, rows in self._groups(split, np.asarray(idx, dtype=np.int64)):
            self.shards[split][s].will_need_mapped(rows)

    def _gather(self, split: str, idx: np.ndarray, pin: bool, later: Optional[np.ndarray]) -> torch.Tensor:
        """Batch ``idx`` gathered, after asking the disk for the batch ``later`` (READ_AHEAD batches on)."""
        if later is not None:
            self.read_ahead(split, later)
        return self.uint8(split, idx, pin)

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Announce the next batches of ``split``: the first ``READ_AHEAD`` are gathered on the reader
        thread now, one more as each is taken; each gather first asks the disk for the batch
        ``READ_AHEAD`` further on (the first ones' pages are asked for here)."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="rayconv-raw-read")
        queue: deque = deque([np.asarray(b), None] for b in batches if len(b))
        for b, _ in list(queue)[:READ_AHEAD]:
            self.read_ahead(split, b)
        self._pending[split] = queue
        for k in range(min(READ_AHEAD, len(queue))):
            self._submit(split, queue, k)

    def _submit(self, split: str, queue: deque, k: int) -> None:
        later = queue[k + READ_AHEAD][0] if k + READ_AHEAD < len(queue) else None
        queue[k][1] = self._reader.submit(self._gather, split, queue[k][0], torch.cuda.is_available(), later)

    def _take(self, split: str, idx: np.ndarray, device: torch.device) -> torch.Tensor:
        """This batch's pixels (read ahead when it was announced), the next announced one started."""
        queue = self._pending.get(split)
        if not queue or not np.array_equal(queue[0][0], idx):
            self._pending.pop(split, None)
            return self.uint8(split, idx, device.type == "cuda")
        _, ahead = queue.popleft()
        if len(queue) >= READ_AHEAD and queue[READ_AHEAD - 1][1] is None:
            self._submit(split, queue, READ_AHEAD - 1)
        if not queue:
            self._pending.pop(split, None)
        return ahead.result() if ahead is not None else self.uint8(split, idx, device.type == "cuda")

    # ------------------------------------------------------------------ Source
    def images(self, split, idx, device, epoch=0, dtype=None):
        dev = torch.device(device)
        idx = np.asarray(idx, dtype=np.int64)
        size = self.sample_shape[1]
        if len(idx) == 0:
            return torch.empty((0, *self.sample_shape), device=dev, dtype=dtype or torch.float32)
        x = to_device(self._take(split, idx, dev), dev).permute(0, 3, 1, 2)   # (B, 3, P, P) uint8, NHWC bytes
        train = split == "train" and (self.augment != "none" or self.random_erase > 0
                                      or self.auto_augment is not None)
        if train and self.augment == "resized-crop":
            x = resize(x, size) if self.stored != size else x
        else:
            x = dec.center(x, size)
        params = self._epoch_params(dev, epoch) if train else {}
        rows = to_device(torch.from_numpy(idx), dev) if params else None
        if "offsets" in params:
            x = random_crop_flip(x, self.pad, params["offsets"][rows], params["flips"][rows])
        elif "boxes" in params:
            x = resized_crop_flip(x, params["boxes"][rows], params["flips"][rows])
        if "aa_groups" in params:
            x = aa.apply(x, params["aa_groups"][rows], self.auto_augment, self.seed, epoch)
        x = dec.normalize(x, dtype)
        return erase(x, params["erase"][rows]) if "erase" in params else x

    def labels(self, split, idx):
        return self.targets[split][torch.as_tensor(np.asarray(idx), dtype=torch.long)]


class RawCenters:
    """A raw shard folder's evaluation images for ``HeldSource``: the stored pixels of ``idx`` through
    ``decode.center``, uint8 (len(idx), 3, S, S), as ``RawShardSource`` gives them before augmenting."""

    def __init__(self, source: RawShardSource):
        self.source = source

    def open(self, split: str) -> None:
        """Nothing to list: the shards were opened and checked with the source."""

    def __call__(self, split: str, idx: np.ndarray) -> torch.Tensor:
        x = self.source.uint8(split, idx).permute(0, 3, 1, 2)
        return dec.center(x, self.source.sample_shape[1]).contiguous()

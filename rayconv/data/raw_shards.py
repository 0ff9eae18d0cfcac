"""Raw-pixel shards (``python -m rayconv.prepare --encoding raw``, format ``rayconv-shards/3``) as a
training source: ``--data shards`` on such a folder.

Nothing is decoded. A batch is gathered from the memory-mapped shards by one ``torch.index_select``
whatever the shards it touches (``raw_gather.RowGather``: no per-shard or per-image Python, the GIL
released for the whole copy), ``READ_AHEAD`` batches ahead, up to ``READERS`` gathers at once on a pool
of reader threads, into one of ``READ_AHEAD + 2`` (B, S, S, 3) uint8 buffers of a ring made once
(pinned on GPU nodes: no page-locked allocation per batch; a buffer is written again only after the
device copy that read it, and the gather that wrote it before, have finished), copied to the device
and augmented there by batched tensor operations. The step thread's part is the hand-off and the
device calls. The kernel is asked for the pages ahead: a split whose shards take at most
1/``RESIDENT_SHARE`` of the node's available memory once, whole, at its first announcement; a larger
one per batch, ``READ_AHEAD`` batches on (``RowGather.file_ranges``, ``OpenShard.will_need_ranges``).
NHWC bytes seen as NCHW (a permuted view) are already channels_last, the layout the model takes on GPUs.

Augmentation, from per-epoch tables of the whole train set drawn from (seed, epoch) alone (the tables
of ``OnDeviceSource``, so that a raw folder streamed and held on the device, ``--data-on-device``,
gives the same batches): ``pad-crop`` and ``none`` start from the evaluation's center crop
(``decode.center``: shorter side to S * 8 // 7, center S x S), as JPEG shards and held data do;
``resized-crop`` crops the stored image (resized to S x S first when the prepare size is not S).
Memory: as ``ShardSource`` (the mappings are shared page cache); the checks of a shard that
disappears or changes are the same (``OpenShard.check``, before a batch's bytes are read), each shard's
at most every ``CHECK_S`` seconds: a random batch touches every shard, and a ``stat`` per shard per
batch, each releasing and taking back the GIL, slows the step thread.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rayconv.data import auto_augment as aa
from rayconv.data import decode as dec
from rayconv.data.augment import erase, random_crop_flip, resize, resized_crop_flip
from rayconv.data.augment_graph import ReplayedAugment
from rayconv.data.folders import SPLITS
from rayconv.data.on_device import OnDeviceSource, _words, pad_for
from rayconv.data.raw_gather import RowGather
from rayconv.data.shard_files import OpenShard, encoding, read_manifest
from rayconv.data.source import Source, to_device
from rayconv.errors import ConfigError, DataError

READ_AHEAD = 8       # batches gathered ahead of their use
RING = READ_AHEAD + 2  # gather buffers of the ring: those read ahead, the one in use, one whose copy may run
RESIDENT_SHARE = 4   # a split of at most 1/RESIDENT_SHARE of the available memory is read ahead whole, once
CHECK_S = 0.5        # a shard's file is checked at most this often (seconds): one stat per shard, not per batch
READERS = 2          # reader threads: gathers in flight at once (more contend with the step thread for the GIL)


def readers() -> int:
    """Reader threads of a source: ``READERS`` (or the environment's ``RAYCONV_RAW_READERS``, for
    benchmarks), at most the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(int(os.environ.get("RAYCONV_RAW_READERS") or READERS), cores))


def available_memory() -> Optional[int]:
    """The node's available memory in bytes (``MemAvailable`` of /proc/meminfo), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Ring:
    """``RING`` gather buffers reused in turn, in the order the batches are announced: ``claim()`` (on
    the step thread, as a gather is submitted) -> (slot, the gather that wrote the slot before or None),
    ``wrote(slot, future)`` records the new one; ``buffers(slot, n, before)`` (on a reader thread) ->
    the slot's uint8 (n, P, P, 3) pixel view and int64 (n,) views for the batch's sample indices and
    labels, after waiting for ``before`` (gathers run at once on several threads) and for the device
    copies last made from them (``copied``). A slot's buffers grow (are made again) only for a batch
    larger than any before."""

    def __init__(self, stored: int, pin: bool):
        self.stored, self.pin = stored, pin
        self.pixels: list[Optional[torch.Tensor]] = [None] * RING
        self.words: list[Optional[torch.Tensor]] = [None] * RING   # (2, n) int64: sample indices, labels
        self.copies: list[Optional[torch.cuda.Event]] = [None] * RING
        self.writers: list[Optional[Future]] = [None] * RING
        self.k = 0

    def claim(self) -> tuple[int, Optional[Future]]:
        slot, self.k = self.k, (self.k + 1) % RING
        return slot, self.writers[slot]

    def wrote(self, slot: int, future: Future) -> None:
        self.writers[slot] = future

    def buffers(self, slot: int, n: int, before: Optional[Future]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if before is not None:
            # (submitted earlier, so running or done: a pool starts its work in order; exception() waits
            # without raising: the batch that gather was for raises when it is taken)
            before.exception()
        done = self.copies[slot]
        if done is not None:
            done.synchronize()   # (releases the GIL; long done: the copy was READ_AHEAD + 1 batches ago)
            self.copies[slot] = None
        buf = self.pixels[slot]
        if buf is None or len(buf) < n:
            p = self.stored
            buf = self.pixels[slot] = torch.empty((n, p, p, 3), dtype=torch.uint8, pin_memory=self.pin)
            self.words[slot] = torch.empty((2, n), dtype=torch.int64, pin_memory=self.pin)
        words = self.words[slot]
        return buf[:n], words[0, :n], words[1, :n]

    def copied(self, slot: int) -> None:
        """The device copies from ``slot``'s buffers are queued on the current stream: mark their end."""
        if self.pin:
            ev = torch.cuda.Event()
            ev.record()
            self.copies[slot] = ev


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
        self.gathers: dict[str, RowGather] = {}
        for split, folder in SPLITS.items():
            entries = self.manifest["splits"][folder]["shards"]
            self.shards[split] = [OpenShard(self.root / e["file"], int(e["rows"])) for e in entries]
            labels = [sh.columns(["label"])["label"] for sh in self.shards[split]]
            self.targets[split] = torch.from_numpy(np.concatenate(labels).astype(np.int64) if labels
                                                   else np.zeros(0, np.int64))
            self.starts[split] = np.cumsum([0] + [sh.rows for sh in self.shards[split]])
            self.gathers[split] = RowGather(self.shards[split])
        self.train_size, self.test_size = len(self.targets["train"]), len(self.targets["test"])
        if self.train_size == 0 or self.test_size == 0:
            raise DataError(f"{self.root} holds {self.train_size} train and {self.test_size} val images: "
                            "both splits need images")
        self._pending: dict[str, deque] = {}
        self._reader: Optional[ThreadPoolExecutor] = None
        self._rings: dict[str, _Ring] = {}
        self._resident: dict[str, bool] = {}   # split -> read ahead whole (no per-batch read-ahead)
        self._graphs: Optional[ReplayedAugment] = None
        self._checked: dict[str, np.ndarray] = {}   # split -> each shard's last passed check (monotonic s)
        self._made: Optional[tuple] = None   # (split, idx, device labels) of the last images() on a GPU

    _epoch_params = OnDeviceSource._epoch_params
    _draw_params = OnDeviceSource._draw_params

    # ------------------------------------------------------------------ bytes
    def uint8(self, split: str, idx: np.ndarray, pin: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The stored pixels of samples ``idx``: uint8 (len(idx), P, P, 3), in pinned memory with
        ``pin``, or written into ``out`` (that shape, contiguous). The shards they touch are checked
        first (DataError naming one that changed); IndexError for a sample outside the split."""
        idx = np.asarray(idx, dtype=np.int64)
        p = self.stored
        if out is None:
            out = torch.empty((len(idx), p, p, 3), dtype=torch.uint8, pin_memory=pin)
        gather = self.gathers[split]
        at, touched = gather.locate(idx)
        for s in touched.tolist():
            self.shards[split][s].check(CHECK_S)
        gather.copy(at, out.view(len(idx), p * p * 3))
        return out

    def read_ahead(self, split: str, idx: np.ndarray) -> None:
        """Ask the kernel to read the pixel bytes of samples ``idx`` from disk now (``madvise(WILLNEED)``
        on the shards' mappings: returns at once, the reads go on in the background)."""
        for s, ranges in self.gathers[split].file_ranges(idx):
            self.shards[split][s].will_need_ranges(ranges)

    def _gather(self, split: str, idx: np.ndarray, ring: _Ring, slot: int, before: Optional[Future],
                later: Optional[np.ndarray], located: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]
                ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``slot``, batch ``idx``'s pixels, sample indices and labels) written into the slot's buffers
        once ``before``, the slot's previous gather, is done, after asking the disk for the batch
        ``later`` (READ_AHEAD batches on) unless the split is read ahead whole. ``located``: the
        batch's byte offsets, shard numbers and labels, found for the whole announcement at once
        (``prefetch``). The indices and labels are written here, on the reader thread, so that the step
        thread only queues their device copies; the reader's own Python is kept to a few calls, as
        the step thread waits for the GIL whenever a reader holds it."""
        if later is not None and not self._resident.get(split):
            self.read_ahead(split, later)
        pixels, rows, labels = ring.buffers(slot, len(idx), before)
        rows.numpy()[:] = idx   # (numpy: no torch call, each of which gives up and takes back the GIL)
        if located is None:
            np.take(self.targets[split].numpy(), idx, out=labels.numpy())
            return slot, self.uint8(split, idx, out=pixels), rows, labels
        at, shard, y = located
        labels.numpy()[:] = y
        self._check(split, shard)
        self.gathers[split].copy(at, pixels.view(len(idx), -1))
        return slot, pixels, rows, labels

    def _check(self, split: str, shard: np.ndarray) -> None:
        """``OpenShard.check`` of the shards numbered in ``shard`` (a batch's, one per sample) whose last
        check is ``CHECK_S`` seconds old (one numpy test while none is)."""
        last = self._checked[split]
        if time.monotonic() - last[shard].min() < CHECK_S:
            return
        for s in np.unique(shard).tolist():
            sh = self.shards[split][s]
            sh.check(CHECK_S)
            last[s] = sh.checked_at

    def _read_ahead_whole(self, split: str) -> bool:
        """Whether ``split``'s shards take at most 1/RESIDENT_SHARE of the available memory; if so,
        their pages are asked of the kernel now, whole (once per split)."""
        if split not in self._resident:
            total = sum(len(sh.mmap) for sh in self.shards[split])
            avail = available_memory()
            self._resident[split] = avail is not None and total * RESIDENT_SHARE <= avail
            if self._resident[split]:
                for sh in self.shards[split]:
                    sh.will_need_mapped(np.arange(sh.rows))
        return self._resident[split]

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Announce the next batches of ``split``: the first ``READ_AHEAD`` are gathered on the reader
        threads now, into the split's ring, one more as each is taken. The pages are asked of the kernel
        here: the split's whole shards when they fit (``_read_ahead_whole``), else the first batches'
        here and, by each gather, the batch ``READ_AHEAD`` further on."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(readers(), thread_name_prefix="rayconv-raw-read")
        if split not in self._rings:
            self._rings[split] = _Ring(self.stored, torch.cuda.is_available())
        queue: deque = deque([np.asarray(b, dtype=np.int64), None, None] for b in batches if len(b))
        if queue:
            # every batch's bytes, shards and labels found at once (a few numpy calls per announcement,
            # on this thread, not a dozen per batch on the readers); a sample outside the split raises
            # when its batch is taken
            every = np.concatenate([e[0] for e in queue])
            try:
                at, shard = self.gathers[split].rows_at(every)
            except IndexError:
                pass
            else:
                labels = self.targets[split].numpy()[every]
                cuts = np.cumsum([len(e[0]) for e in queue])[:-1]
                for e, a, sh, y in zip(queue, np.split(at, cuts), np.split(shard, cuts), np.split(labels, cuts)):
                    e[2] = (a, sh, y)
            if split not in self._checked:
                self._checked[split] = np.array([sh.checked_at for sh in self.shards[split]])
        if not self._read_ahead_whole(split):
            for b, _, _ in list(queue)[:READ_AHEAD]:
                self.read_ahead(split, b)
        self._pending[split] = queue
        for k in range(min(READ_AHEAD, len(queue))):
            self._submit(split, queue, k)

    def _submit(self, split: str, queue: deque, k: int) -> None:
        later = queue[k + READ_AHEAD][0] if k + READ_AHEAD < len(queue) else None
        ring = self._rings[split]
        slot, before = ring.claim()
        queue[k][1] = self._reader.submit(self._gather, split, queue[k][0], ring, slot, before, later, queue[k][2])
        ring.wrote(slot, queue[k][1])

    def _take(self, split: str, idx: np.ndarray, device: torch.device
              ) -> tuple[Optional[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ring slot or None, this batch's pixels, sample indices, labels): read ahead into the split's
        ring when it was announced (the next announced one started), else read now into tensors of
        their own (pinned on a GPU)."""
        queue = self._pending.get(split)
        ahead = None
        if not queue or not np.array_equal(queue[0][0], idx):
            self._pending.pop(split, None)
        else:
            _, ahead, _ = queue.popleft()
            if len(queue) >= READ_AHEAD and queue[READ_AHEAD - 1][1] is None:
                self._submit(split, queue, READ_AHEAD - 1)
            if not queue:
                self._pending.pop(split, None)
        if ahead is not None:
            return ahead.result()
        pin = device.type == "cuda"
        rows = torch.from_numpy(idx)
        labels = self.targets[split][rows]
        return None, self.uint8(split, idx, pin), (rows.pin_memory() if pin else rows), (labels.pin_memory() if pin else labels)

    # ------------------------------------------------------------------ Source
    def images(self, split, idx, device, epoch=0, dtype=None):
        dev = torch.device(device)
        idx = np.asarray(idx, dtype=np.int64)
        if len(idx) == 0:
            return torch.empty((0, *self.sample_shape), device=dev, dtype=dtype or torch.float32)
        slot, host, rows, labels = self._take(split, idx, dev)
        train = split == "train" and (self.augment != "none" or self.random_erase > 0
                                      or self.auto_augment is not None)
        params = self._epoch_params(dev, epoch) if train else {}
        indexed = {"rows": rows} if params else {}   # (the tables are indexed by sample)
        if dev.type == "cuda" and self.auto_augment is None:
            # (the copy from the pinned ring buffer and the augmentation: one graph replay, augment_graph.py)
            x = self._replayed((train, dtype, None), {}, pixels=host, **indexed, **params)
        else:
            x = self._augment((train, dtype, epoch), pixels=to_device(host, dev),
                              **{k: to_device(v, dev) for k, v in indexed.items()}, **params)
        if dev.type == "cuda":
            # the batch's labels, from the pinned buffer the reader thread filled, for ``device_labels``
            self._made = (split, idx, labels.to(dev, non_blocking=True))
            if slot is not None:
                self._rings[split].copied(slot)   # (the buffers are written again only after these copies)
        return x

    def device_labels(self, split, idx, device):
        made, self._made = self._made, None
        if made is None or made[0] != split or not (made[1] is idx or np.array_equal(made[1], idx)):
            return None
        return made[2]

    def _augment(self, key: tuple, pixels: torch.Tensor, rows: Optional[torch.Tensor] = None,
                 **params: torch.Tensor) -> torch.Tensor:
        """Stored pixels ``pixels`` (uint8 (n, P, P, 3) on the device) of samples ``rows`` (device int64
        (n,); only with ``params``) -> float (n, 3, S, S) of the key's dtype: center crop (or the
        resized crop's resize), the epoch's ``params`` (``_epoch_params``), normalisation, erasing.
        ``key`` = (train, dtype, epoch; the epoch is read by auto-augment only)."""
        train, dtype, epoch = key
        size = self.sample_shape[1]
        x = pixels.permute(0, 3, 1, 2)   # (n, 3, P, P) uint8, NHWC bytes
        if train and self.augment == "resized-crop":
            x = resize(x, size) if self.stored != size else x
        else:
            x = dec.center(x, size)
        if "offsets" in params:
            x = random_crop_flip(x, self.pad, params["offsets"][rows], params["flips"][rows])
        elif "boxes" in params:
            x = resized_crop_flip(x, params["boxes"][rows], params["flips"][rows])
        if "aa_groups" in params:
            x = aa.apply(x, params["aa_groups"][rows], self.auto_augment, self.seed, epoch)
        x = dec.normalize(x, dtype)
        return erase(x, params["erase"][rows]) if "erase" in params else x

    @property
    def _replayed(self) -> ReplayedAugment:
        """``_augment`` replayed as a CUDA graph per batch shape (made on first use)."""
        if self._graphs is None:
            self._graphs = ReplayedAugment(self._augment)
        return self._graphs

    def labels(self, split, idx):
        return self.targets[split][torch.as_tensor(np.asarray(idx), dtype=torch.long)]

    def add_val_split(self) -> None:
        """"val": the train shards, center-cropped and not augmented (``images`` augments "train" only)."""
        for table in (self.shards, self.starts, self.targets, self.gathers):
            table["val"] = table["train"]


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

"""Raw-pixel shards (``python -m rayconv.prepare --encoding raw``, format ``rayconv-shards/3``) as a
training source: ``--data shards`` on such a folder.

Nothing is decoded. A batch is gathered from the memory-mapped shards by a reader process of the
source's own (``raw_reader.ReaderProcess``: its own GIL, so that the step thread never waits for a reader
to give it back), ``READ_AHEAD`` batches ahead, into one of ``RING`` buffers of a shared-memory ring made
once per split (page-locked on GPU nodes: no page-locked allocation per batch; a buffer is written again
only after the device copy that read it has finished), with the batch's sample indices and labels; the
step thread sends one request and takes one reply per batch, then copies the buffers to the device,
where the batch is augmented by batched tensor operations. On a GPU the copy and the augmentation run
on a side stream, the next announced batch's as soon as this one is handed over (and a new
announcement's first batch as it is announced: the next epoch's during the last step of this one), so
that they overlap the step's compute instead of preceding it on the step's stream (``images``). The kernel is
asked for the pages ahead: a split whose shards take at most 1/``RESIDENT_SHARE`` of the node's available
memory once, whole, at its first announcement; a larger one per batch, ``READ_AHEAD`` batches on (by the
reader process). NHWC bytes seen as NCHW (a permuted view) are already channels_last, the layout the model
takes on GPUs.

Augmentation, from per-epoch tables of the whole train set drawn from (seed, epoch) alone (the tables
of ``OnDeviceSource``, so that a raw folder streamed and held on the device, ``--data-on-device``,
gives the same batches): ``pad-crop`` and ``none`` start from the evaluation's center crop
(``decode.center``: shorter side to S * 8 // 7, center S x S), as JPEG shards and held data do;
``resized-crop`` crops the stored image (resized to S x S first when the prepare size is not S).
Memory: as ``ShardSource`` (the mappings are shared page cache); the checks of a shard that
disappears or changes are the same (``OpenShard.check``, before a batch's bytes are read), each shard's
at most every ``CHECK_S`` seconds (a random batch touches every shard). A batch that was not announced
is read on the step thread itself (``uint8``).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rayconv.data import auto_augment as aa
from rayconv.data import decode as dec
from rayconv.data.augment import erase, random_crop_flip, resize, resized_crop_flip
from rayconv.data.augment_graph import ReplayedAugment
from rayconv.data.folders import SPLITS
from rayconv.data.on_device import OnDeviceSource, augment_words, pad_for
from rayconv.data.raw_gather import RowGather
from rayconv.data.raw_reader import CHECK_S, ReaderProcess
from rayconv.data.shard_files import OpenShard, encoding, read_manifest
from rayconv.data.shard_remote import StreamReads, copy_rows, files_of
from rayconv.data.source import Source, to_device
from rayconv.errors import ConfigError, DataError

READ_AHEAD = 8       # batches gathered ahead of their use
RING = READ_AHEAD + 2  # buffers of a split's ring: those read ahead, the one in use, one whose copy may run
RESIDENT_SHARE = 4   # a split of at most 1/RESIDENT_SHARE of the available memory is read ahead whole, once


def available_memory() -> Optional[int]:
    """The node's available memory in bytes (``MemAvailable`` of /proc/meminfo), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Aside:
    """A batch made ahead on the side stream: what it was made for, its images and device labels, the
    event that ends its making."""

    def __init__(self, idx: np.ndarray, epoch: int, dtype, x: torch.Tensor, labels: torch.Tensor, event):
        (self.idx, self.epoch, self.dtype, self.x, self.labels,
         self.event) = idx, epoch, dtype, x, labels, event

    def serves(self, idx: np.ndarray, epoch: int, dtype) -> bool:
        return self.epoch == epoch and self.dtype == dtype and (self.idx is idx
                                                                or np.array_equal(self.idx, idx))


def augmentation_words(augment: str, image_size: int, random_erase: float, auto_augment: Optional[str],
                       stored: int) -> str:
    """What raw shards' training samples get, in words (``Source.augmentation``); ``stored``: the
    prepare size in pixels."""
    pad, flip = (pad_for(image_size), True) if augment == "pad-crop" else (0, augment == "resized-crop")
    return augment_words(augment, pad, flip, random_erase, auto_augment).replace(
        " (on the device)", f" (raw pixels {stored}x{stored}, no decode)")


class RawShardSource(Source, StreamReads):
    """A raw-pixel shard folder (``root``; or ``stream``: a set streamed from object storage,
    ``shard_stream``): labels read at open, pixels gathered per batch. ``images`` -> float (len(idx), 3,
    S, S) of ``dtype``, S = ``image_size``, normalised by ImageNet's mean and std (as JPEG shards).
    ``uint8(split, idx)`` -> the stored pixels, uint8 (len(idx), P, P, 3), P the prepare size. Raises
    DataError for a folder whose manifest does not match its files or that holds JPEGs; ConfigError for
    an unknown ``augment``."""

    def __init__(self, root: str, image_size: int, seed: int, augment: str = "pad-crop",
                 random_erase: float = 0.0, auto_augment: Optional[str] = None, stream: Optional[Any] = None):
        self.stream = stream   # a set in object storage larger than the cache (shard_stream.ShardStream)
        self.root = Path(root) if stream is None else stream.folder
        self.manifest = read_manifest(self.root) if stream is None else stream.manifest
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
        self.pad, self.flip = (
            (pad_for(image_size), True) if augment == "pad-crop" else (0, augment == "resized-crop")
        )
        self._params: dict = {}
        self._ahead: dict = {}   # (OnDeviceSource's next-epoch tables, drawn on its pool)
        self._pool = None
        self.augmentation = augmentation_words(augment, image_size, random_erase, auto_augment, self.stored)
        self.shards: dict[str, list[OpenShard]] = {}
        self.starts: dict[str, np.ndarray] = {}
        self.targets: dict[str, torch.Tensor] = {}
        self.gathers: dict[str, Optional[RowGather]] = {}
        for split, folder in SPLITS.items():
            entries = self.manifest["splits"][folder]["shards"]
            self.shards[split] = ([OpenShard(self.root / e["file"], int(e["rows"])) for e in entries]
                                  if stream is None else stream.handles(folder))
            labels = [sh.columns(["label"])["label"] for sh in self.shards[split]]
            self.targets[split] = torch.from_numpy(np.concatenate(labels).astype(np.int64) if labels
                                                   else np.zeros(0, np.int64))
            self.starts[split] = np.cumsum([0] + [sh.rows for sh in self.shards[split]])
            self.gathers[split] = RowGather(self.shards[split]) if stream is None else None
        self.train_size, self.test_size = len(self.targets["train"]), len(self.targets["test"])
        if self.train_size == 0 or self.test_size == 0:
            raise DataError(f"{self.root} holds {self.train_size} train and {self.test_size} val images: "
                            "both splits need images")
        self._pending: dict[str, deque] = {}   # split -> [idx, request number] of the announced batches
        self._reader: Optional[ReaderProcess] = None
        self._resident: dict[str, bool] = {}   # split -> read ahead whole (no per-batch read-ahead)
        self._graphs: Optional[ReplayedAugment] = None
        self._side = None   # (a GPU's side stream, where batches are made: ``images``)
        self._ready: dict[str, _Aside] = {}   # split -> its next announced batch, made ahead
        # split -> (device, dtype) its batches were last made aside for
        self._aside_on: dict[str, tuple] = {}
        self._made: Optional[tuple] = None   # (split, idx, device labels) of the last images() on a GPU

    _epoch_params = OnDeviceSource._epoch_params
    _draw_params = OnDeviceSource._draw_params

    # ------------------------------------------------------------------ bytes
    def uint8(self, split: str, idx: np.ndarray, pin: bool = False,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The stored pixels of samples ``idx``: uint8 (len(idx), P, P, 3), in pinned memory with
        ``pin``, or written into ``out`` (that shape, contiguous). The shards they touch are checked
        first (DataError naming one that changed); IndexError for a sample outside the split."""
        idx = np.asarray(idx, dtype=np.int64)
        p = self.stored
        if out is None:
            out = torch.empty((len(idx), p, p, 3), dtype=torch.uint8, pin_memory=pin)
        if self.stream is not None:
            self._streamed(split, idx, out.view(len(idx), p * p * 3).numpy())
            return out
        gather = self.gathers[split]
        at, touched = gather.locate(idx)
        for s in touched.tolist():
            self.shards[split][s].check(CHECK_S)
        gather.copy(at, out.view(len(idx), p * p * 3))
        return out

    def _streamed(self, split: str, idx: np.ndarray, out: np.ndarray) -> None:
        """Rows ``idx`` of a streamed set into ``out`` (len(idx), P * P * 3): one stream read of their
        shards (fetched ahead, mapped while copied). IndexError for a sample outside the split."""
        shards, starts = self.shards[split], self.starts[split]
        inside = idx[(idx >= 0) & (idx < starts[-1])]   # (copy_rows names a sample outside)
        with self.stream.read(split, files_of(shards, starts, inside)) as opened:
            copy_rows(shards, starts, idx, opened, out)

    def read_ahead(self, split: str, idx: np.ndarray) -> None:
        """Ask the kernel to read the pixel bytes of samples ``idx`` from disk now (``madvise(WILLNEED)``
        on the shards' mappings: returns at once, the reads go on in the background)."""
        for s, ranges in self.gathers[split].file_ranges(idx):
            self.shards[split][s].will_need_ranges(ranges)

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

    def reader(self) -> ReaderProcess:
        """The source's reader process (started on the first announcement; ended with the source)."""
        if self._reader is None:
            files = {split: [(str(sh.path), sh.rows, sh.identity) for sh in shards]
                     for split, shards in self.shards.items()}
            self._reader = ReaderProcess(files, self.stored * self.stored * 3, torch.cuda.is_available())
        return self._reader

    def close(self) -> None:
        """End the reader process (a source is closed when its run ends, or when it is collected)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self.stream is not None:
            self.stream.close()   # (a later read starts it again)
        self._pending.clear()
        self._ready.clear()
        self._aside_on.clear()

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Announce the next batches of ``split``: the first ``READ_AHEAD`` are requested of the reader
        process now, into the split's ring, one more as each is taken. The pages are asked of the kernel
        here, the split's whole shards when they fit (``_read_ahead_whole``), else by the reader process
        for each batch ``READ_AHEAD`` further on and for the first batches now. On a GPU, where the split's
        batches were made on the side stream before, the first announced batch is made there now.
        A streamed set's batches are announced to its stream (fetched ahead) and read on the step
        thread (``uint8``)."""
        if self.stream is not None:
            self._ready.pop(split, None)
            self._drop_pending(split)
            self.stream.announce(split, [self.files(split, b) for b in batches if len(b)])
            return
        reader = self.reader()
        self._ready.pop(split, None)
        self._drop_pending(split)
        queue: deque = deque([np.asarray(b, dtype=np.int64), None] for b in batches if len(b))
        if not queue:
            return
        reader.ring(split, max(len(e[0]) for e in queue), RING)
        if not self._read_ahead_whole(split):
            for b, _ in list(queue)[:READ_AHEAD]:
                self.read_ahead(split, b)
        self._pending[split] = queue
        for k in range(min(READ_AHEAD, len(queue))):
            self._submit(split, queue, k)
        made = self._aside_on.get(split)
        # (on a GPU: the first announced batch made now, while the current step computes)
        if made is not None:
            self._ready[split] = self._made_aside(split, queue[0][0], made[0], epoch, made[1])

    def _drop_pending(self, split: str) -> None:
        """Forget ``split``'s announced batches (a new announcement, or a batch taken that was not the
        next announced): the reader process's replies to their requests are dropped as they come."""
        old = self._pending.pop(split, None)
        if old and self._reader is not None:
            self._reader.forget(n for _, n in old)

    def _submit(self, split: str, queue: deque, k: int) -> None:
        later = (
            queue[k + READ_AHEAD][0] if k + READ_AHEAD < len(queue) and not self._resident[split] else None
        )
        queue[k][1] = self._reader.submit(split, queue[k][0], later)

    def _take(self, split: str, idx: np.ndarray, device: torch.device
              ) -> tuple[Optional[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ring slot or None, this batch's pixels (n, P, P, 3), sample indices, labels): from the reader
        process when it was announced (the next announced one requested), else read now into tensors of
        their own (pinned on a GPU). Raises DataError for a shard that changed, IndexError for a sample
        outside the split."""
        queue = self._pending.get(split)
        ahead = None
        if not queue or not np.array_equal(queue[0][0], idx):
            self._drop_pending(split)
        else:
            _, ahead = queue.popleft()
            if len(queue) >= READ_AHEAD and queue[READ_AHEAD - 1][1] is None:
                self._submit(split, queue, READ_AHEAD - 1)
            if not queue:
                self._pending.pop(split, None)
        if ahead is not None:
            slot, pixels, rows, labels = self._reader.result(ahead)
            return slot, pixels.view(len(idx), self.stored, self.stored, 3), rows, labels
        pin = device.type == "cuda"
        rows = torch.from_numpy(idx)
        labels = self.targets[split][rows]
        return (None, self.uint8(split, idx, pin), (rows.pin_memory() if pin else rows),
                (labels.pin_memory() if pin else labels))

    # ------------------------------------------------------------------ Source
    def images(self, split, idx, device, epoch=0, dtype=None):
        dev = torch.device(device)
        idx = np.asarray(idx, dtype=np.int64)
        if len(idx) == 0:
            return torch.empty((0, *self.sample_shape), device=dev, dtype=dtype or torch.float32)
        if dev.type != "cuda" or self.auto_augment is not None:
            x, labels = self._make(split, idx, dev, epoch, dtype)
            if dev.type == "cuda":
                self._made = (split, idx, labels)
            return x
        # On a GPU each batch is made on a side stream, the next announced one as soon as this one is
        # handed over: its copy from the ring and its augmentation run while this batch's step computes.
        main = torch.cuda.current_stream(dev)
        self._aside_on[split] = (dev, dtype)
        ready = self._ready.pop(split, None)
        if ready is None or not ready.serves(idx, epoch, dtype):
            ready = self._made_aside(split, idx, dev, epoch, dtype)
        main.wait_event(ready.event)
        ready.x.record_stream(main)        # (made on the side stream: not reused there before this one's use)
        ready.labels.record_stream(main)
        self._made = (split, idx, ready.labels)
        queue = self._pending.get(split)
        if queue:
            self._ready[split] = self._made_aside(split, queue[0][0], dev, epoch, dtype)
        return ready.x

    def _made_aside(self, split: str, idx: np.ndarray, dev: torch.device, epoch: int, dtype) -> "_Aside":
        """``_make`` on the source's side stream (made once), and the event that ends it there."""
        if self._side is None:
            self._side = torch.cuda.Stream(dev)
        with torch.cuda.stream(self._side):
            x, labels = self._make(split, idx, dev, epoch, dtype)
            return _Aside(idx, epoch, dtype, x, labels, self._side.record_event())

    def _make(self, split: str, idx: np.ndarray, dev: torch.device, epoch: int,
              dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch ``idx`` of ``split`` augmented on ``dev``, its labels: on the device on a GPU, else
        None) on the current stream: taken from the ring (``_take``), copied and augmented (one graph
        replay on a GPU: augment_graph.py)."""
        slot, host, rows, labels = self._take(split, idx, dev)
        train = split == "train" and (self.augment != "none" or self.random_erase > 0
                                      or self.auto_augment is not None)
        params = self._epoch_params(dev, epoch) if train else {}
        indexed = {"rows": rows} if params else {}   # (the tables are indexed by sample)
        if dev.type == "cuda" and self.auto_augment is None:
            x = self._replayed((train, dtype, None), {}, pixels=host, **indexed, **params)
        else:
            x = self._augment((train, dtype, epoch), pixels=to_device(host, dev),
                              **{k: to_device(v, dev) for k, v in indexed.items()}, **params)
        if dev.type != "cuda":
            return x, None
        # the batch's labels, from the buffer the reader process filled, for ``device_labels``
        on_device = labels.to(dev, non_blocking=True)
        if slot is not None:
            self._reader.copied(split, slot)   # (the buffers are written again only after these copies)
        return x, on_device

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
        self.close()   # (a reader process started before reads the splits it was given)


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

"""Prepared shards (``python -m rayconv.prepare``) as a training source: ``--data shards``.

The folder's format, its checks and how a shard is opened are in ``rayconv/data/shard_files.py``.

Memory: every shard is memory-mapped (read-only, shared; Arrow reads it zero-copy): JPEG bytes are read from
the OS page cache, which the actors and forked loader processes of a node share, so each process's
private memory (RssAnon) holds labels and image sizes (16 bytes a sample) but no image bytes, whatever
the folder's size. Only the first pipeline stage reads JPEG bytes; the pages a node touches are those
of its own samples. Read-ahead: when batches are announced (``prefetch``) the byte ranges of the next
``READ_AHEAD`` batches are handed to ``posix_fadvise(WILLNEED)``, one batch more as each is taken, so
that a cold page cache is read from disk ahead of the loader's decode. Before a batch's bytes are read
the shards it touches are checked (``OpenShard.check``): a file that disappeared or changed raises
DataError naming it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from rayconv.data import auto_augment as aa
from rayconv.data import decode as dec
from rayconv.data.augment import erase, erase_params
from rayconv.data.folders import SPLITS
from rayconv.data.on_device import pad_for
from rayconv.data.shard_files import FORMAT, MANIFEST, OpenShard, encoding, is_prepared, read_manifest
from rayconv.data.shard_remote import StreamReads
from rayconv.data.source import Source, stable_seed
from rayconv.errors import DataError

__all__ = ["FORMAT", "MANIFEST", "ShardSource", "is_prepared", "read_manifest"]

READ_AHEAD = 8   # batches whose bytes are requested from the disk ahead of their decode


def augmentation_words(augment: str, image_size: int, random_erase: float, auto_augment: Optional[str],
                       decode: str) -> str:
    """What JPEG shards' training samples get, in words (``Source.augmentation``)."""
    return {"resized-crop": "RandomResizedCrop(0.08-1) + flip",
            "pad-crop": f"center crop, pad {pad_for(image_size)} + random crop + flip",
            "none": "center crop"}[augment] \
        + (f", auto-augment {auto_augment} (batched in {aa.GROUPS} groups)" if auto_augment else "") \
        + (f", random erasing p={random_erase:g}" if random_erase > 0 else "") + f" (decode {decode})"


class ShardSource(Source, StreamReads):
    """A prepared folder: labels read at once, JPEG bytes on first use, decoded per batch.

    ``decode``: ``gpu`` (batched nvJPEG on the actor's GPU, then crop, flip and normalise there, on a
    side CUDA stream, one batch ahead), ``cpu`` (``workers`` DataLoader processes decode with
    libjpeg-turbo, crop and flip; the actor normalises on its device) or ``auto`` (cpu: on a GPU, gpu's decode
    and crops take GPU time from the model, and ResNet-50 trains closer to its synthetic-data rate with
    cpu; benchmarks/RESULTS.md, Real image files). Raises DataError for
    a folder whose manifest does not match its files. ``stream``: a set streamed from object storage
    (``shard_stream``; ``root`` unused): each batch's bytes read through it, decoded on the actor's thread.

    Overlap on GPUs: when batch k is taken, batch k + 1 is decoded and cropped on a side stream; the
    caller's stream waits on an event before using batch k. torchvision's batched nvJPEG call returns
    when its decode is done (it synchronises its own stream; baseline JPEGs, as prepare writes, go to
    the hardware JPEG decoder of A100/H100-class GPUs), so the actor's thread spends that time before
    it launches step k, while step k - 1 still runs on the GPU."""

    def __init__(self, root: str, image_size: int, seed: int, workers: int, decode: str = "auto",
                 augment: str = "resized-crop", random_erase: float = 0.0,
                 auto_augment: Optional[str] = None, stream: Optional[Any] = None):
        self.stream = stream   # a set in object storage larger than the cache (shard_stream.ShardStream)
        self.root = Path(root) if stream is None else stream.folder
        # (the policy's transform)
        self.auto_augment = aa.make_transform(auto_augment) if auto_augment else None
        self.manifest = read_manifest(self.root) if stream is None else stream.manifest
        if stream is not None:
            workers = 0   # (the batch's bytes are read on the actor's thread, through the stream)
        if encoding(self.manifest) != "jpeg":
            raise DataError(f"{self.root} holds raw pixels, not JPEGs: read it with "
                            "raw_shards.RawShardSource (make_source picks it)")
        self.classes = list(self.manifest["classes"])
        self.num_classes = len(self.classes)
        self.sample_shape = (3, image_size, image_size)
        self.size, self.seed, self.workers, self.decode = image_size, seed, workers, decode
        self.augment, self.random_erase, self.name = augment, random_erase, "shards"
        self.augmentation = augmentation_words(augment, image_size, random_erase, auto_augment, decode)
        self.entries = {s: self.manifest["splits"][f]["shards"] for s, f in SPLITS.items()}
        self.targets: dict[str, torch.Tensor] = {}
        self.hw: dict[str, np.ndarray] = {}
        self.shards: dict[str, list[OpenShard]] = {}
        self.starts: dict[str, np.ndarray] = {}   # per split: first sample of each shard, then the total
        for split, entries in self.entries.items():
            opened = ([OpenShard(self.root / e["file"], int(e["rows"])) for e in entries] if stream is None
                      else stream.handles(SPLITS[split]))
            cols = [sh.columns(["label", "height", "width"]) for sh in opened]
            col = lambda name: np.concatenate([c[name] for c in cols]) if cols \
                else np.zeros(0, np.int32)  # noqa: E731
            self.targets[split] = torch.from_numpy(col("label").astype(np.int64))
            self.hw[split] = np.stack([col("height"), col("width")], axis=1)
            self.shards[split] = opened
            self.starts[split] = np.cumsum([0] + [sh.rows for sh in opened])
        self.train_size, self.test_size = len(self.targets["train"]), len(self.targets["test"])
        if self.train_size == 0 or self.test_size == 0:
            raise DataError(f"{self.root} holds {self.train_size} train and {self.test_size} val images: "
                            "both splits need images")
        self._pending: dict[str, dict[str, Any]] = {}
        self._stream: Optional[torch.cuda.Stream] = None
        # GPU decode runs on a thread of its own: nvJPEG holds the calling thread until its batch is
        # decoded, so the actor's thread launches the step while the next batch decodes.
        self._decoder: Optional[ThreadPoolExecutor] = None

    # ------------------------------------------------------------------ bytes
    def _locate(self, split: str, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row in shard) of each sample ``idx`` of ``split``."""
        starts = self.starts[split]
        shard = np.searchsorted(starts, idx, side="right") - 1
        return shard, np.asarray(idx) - starts[shard]

    def check(self, split: str, idx: np.ndarray) -> None:
        """Raise DataError naming the first shard of samples ``idx`` that disappeared or changed since
        open."""
        for s in np.unique(self._locate(split, idx)[0]):
            self.shards[split][s].check()

    def read_ahead(self, split: str, idx: np.ndarray) -> None:
        """Ask the kernel to read the JPEG bytes of samples ``idx`` from disk now
        (``OpenShard.will_need``)."""
        shard, row = self._locate(split, idx)
        for s in np.unique(shard):
            self.shards[split][s].will_need(row[shard == s])

    def jpegs(self, split: str, idx: np.ndarray) -> list[torch.Tensor]:
        """The JPEG bytes of samples ``idx`` of ``split``: 1-D uint8 CPU tensors (views of one copy of
        the batch's bytes, read from the memory-mapped shards after ``check``)."""
        shard, row = self._locate(split, idx)
        if self.stream is not None:   # (the shards mapped while the bytes are copied)
            shards = self.shards[split]
            with self.stream.read(split, frozenset(shards[s].name for s in np.unique(shard))):
                pieces = [shards[s].jpeg(int(r)) for s, r in zip(shard, row)]
                flat = torch.from_numpy(np.concatenate(pieces))
            return list(torch.split(flat, [len(p) for p in pieces]))
        self.check(split, idx)
        pieces = [self.shards[split][s].jpeg(int(r)) for s, r in zip(shard, row)]
        flat = torch.from_numpy(np.concatenate(pieces))
        return list(torch.split(flat, [len(p) for p in pieces]))

    def params(self, split: str, epoch: int, idx: np.ndarray) -> Optional[list[tuple]]:
        """Each training sample's crop and flip (``decode.crop_params``, or ``decode.pad_crop_params``
        under pad-crop), from (seed, epoch, index) and its stored size; None for evaluation and under
        ``--augment none`` (center crop)."""
        if split != "train" or self.augment == "none":
            return None
        if self.augment == "pad-crop":
            return [dec.pad_crop_params(self.size, stable_seed(self.seed, split, epoch, int(i))) for i in idx]
        return [dec.crop_params(int(self.hw[split][i, 0]), int(self.hw[split][i, 1]),
                                stable_seed(self.seed, split, epoch, int(i))) for i in idx]

    def uint8_batch(self, split: str, idx: np.ndarray, epoch: int, device: torch.device) -> torch.Tensor:
        """Decoded and cropped samples ``idx``: uint8 (len(idx), 3, S, S) on ``device`` (no overlap)."""
        return dec.transform(dec.decode(self.jpegs(split, idx), device), self.size,
                             self.params(split, epoch, idx), self.augment)

    # ------------------------------------------------------------------ Source
    def _use_gpu(self, device: torch.device) -> bool:
        if self.decode == "gpu" and device.type != "cuda":
            raise DataError("--decode gpu decodes on the actor's GPU: use --device cuda or --decode cpu")
        return device.type == "cuda" and self.decode == "gpu"

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Announce this actor's next batches of ``split``: CPU decode starts them in the loader's
        workers; GPU decode launches each when the one before it is taken. The bytes of the first
        ``READ_AHEAD`` batches are requested from the disk at once (``read_ahead``)."""
        batches = [np.asarray(b) for b in batches if len(b)]
        if self.stream is not None:
            self.stream.announce(split, [self.files(split, b) for b in batches])
        self._pending[split] = {"epoch": epoch, "queue": deque(batches), "loader": None, "launched": None}
        for b in batches[:READ_AHEAD]:
            self.read_ahead(split, b)

    def images(self, split, idx, device, epoch=0, dtype=None):
        device = torch.device(device)
        if len(idx) == 0:
            return torch.empty((0, *self.sample_shape), device=device, dtype=dtype or torch.float32)
        pending = self._pending.get(split)   # one announced sequence per split: evaluation keeps training's
        if pending is None or pending["epoch"] != epoch or not pending["queue"] \
                or not np.array_equal(pending["queue"][0], idx):
            self.prefetch(split, epoch, [idx])          # not announced: decode this batch alone
            pending = self._pending[split]
        try:
            self.check(split, idx)
        except DataError:
            self._drop(split)
            raise
        if len(pending["queue"]) > READ_AHEAD:
            self.read_ahead(split, pending["queue"][READ_AHEAD])
        x = (self._take_gpu(split, pending, device) if self._use_gpu(device)
             else self._take_cpu(split, pending))
        if not pending["queue"]:
            self._pending.pop(split, None)   # the last announced batch: the loader and its workers go with it
        x = x.to(device, non_blocking=True)
        if split == "train" and self.auto_augment is not None:
            x = aa.apply(x, aa.sample_groups(self.seed, epoch, idx).to(device), self.auto_augment, self.seed,
                         epoch)
        x = dec.normalize(x, dtype)
        return self._erase(x, epoch, idx) if split == "train" and self.random_erase > 0 else x

    def _erase(self, x: torch.Tensor, epoch: int, idx: np.ndarray) -> torch.Tensor:
        """``x`` with each sample's RandomErasing rectangle (``augment.erase_params``, from (seed, epoch,
        index) alone) set to 0."""
        boxes = torch.cat([erase_params(1, self.size, self.size, self.random_erase,
                                        torch.Generator().manual_seed(stable_seed(self.seed, "erase", epoch,
                                                                                  int(i))))
                           for i in idx])
        boxes = boxes.pin_memory().to(x.device, non_blocking=True) if x.is_cuda else boxes
        return erase(x, boxes)

    def _take_gpu(self, split: str, pending: dict, device: torch.device) -> torch.Tensor:
        """This batch (launched ahead, or now), after handing the next one to the decode thread."""
        idx = pending["queue"].popleft()
        launched: Optional[Future] = pending["launched"]
        current = launched.result() if launched is not None else self._launch(split, pending["epoch"], idx,
                                                                              device)
        if pending["queue"]:
            if self._decoder is None:
                self._decoder = ThreadPoolExecutor(1, thread_name_prefix="rayconv-decode")
            pending["launched"] = self._decoder.submit(self._launch, split, pending["epoch"],
                                                       pending["queue"][0], device)
        else:
            pending["launched"] = None
        x, event = current
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        x.record_stream(stream)   # made on the side stream, used on this one
        return x

    def _launch(self, split: str, epoch: int, idx: np.ndarray, device: torch.device):
        """Queue decode + crop of batch ``idx`` on the side stream; returns (uint8 batch, done event)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        jpegs, params = self.jpegs(split, idx), self.params(split, epoch, idx)
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            try:
                x = dec.transform(dec.decode(jpegs, device), self.size, params, self.augment)
            except RuntimeError as e:   # nvJPEG's error on bytes of a shard that passed its checks
                raise DataError(f"cannot decode a sample of {self.root} on {device} ({e}): prepare the "
                                "folder again, or use --decode cpu") from None
            event = torch.cuda.Event()
            event.record(self._stream)
        return x, event

    def _take_cpu(self, split: str, pending: dict) -> torch.Tensor:
        if self.stream is not None:   # (one read of the batch's shards, decoded on this thread)
            idx = pending["queue"].popleft()
            return self.uint8_batch(split, idx, pending["epoch"], torch.device("cpu"))
        if pending["loader"] is None:   # forked workers share the shards' mappings
            sampler = _BatchSampler(list(pending["queue"]), pending["epoch"])
            workers = self.workers
            loader = DataLoader(_Samples(self, split), batch_sampler=sampler, num_workers=workers,
                                generator=torch.Generator(), prefetch_factor=2 if workers else None,
                                multiprocessing_context="fork" if workers else None,
                                pin_memory=torch.cuda.is_available())
            pending["loader"] = iter(loader)
        pending["queue"].popleft()
        try:
            return next(pending["loader"])
        # a worker's error, or a worker killed (SIGBUS: a shard shrank)
        except (RuntimeError, DataError) as e:
            lines = str(e).strip().splitlines()
            if isinstance(e, DataError):
                named = [x for x in lines if str(self.root) in x] or lines[-1:]
                error = DataError(named[-1].removeprefix("rayconv.errors.DataError: "))
            else:
                error = DataError(f"cannot decode a sample of {self.root} ({lines[-1] if lines else e}): "
                                  "prepare the folder again")
        # (outside the except clause, so that no traceback holds the loader: its workers stop now)
        del pending
        self._drop(split)
        self._check_all(split)   # (a shard that changed is named as that)
        raise error

    def _drop(self, split: str) -> None:
        """Forget the batches announced for ``split`` after a failure: the loader, and its worker
        processes with it, stop at once rather than at a later garbage collection (each worker's
        shutdown then waits seconds)."""
        pending = self._pending.pop(split, None)
        if pending is not None:
            pending["loader"] = pending["launched"] = None

    def _check_all(self, split: str) -> None:
        for sh in self.shards[split]:
            sh.check()

    def labels(self, split, idx):
        return self.targets[split][torch.as_tensor(idx, dtype=torch.long)]

    def add_val_split(self) -> None:
        """"val": the train shards, center-cropped and not augmented (``params``, ``images``)."""
        for table in (self.entries, self.targets, self.hw, self.shards, self.starts):
            table["val"] = table["train"]


class _Samples(Dataset):
    """One sample per item ``(index, epoch)``: decoded on the CPU, cropped and flipped, uint8 (3, S, S)."""

    def __init__(self, source: ShardSource, split: str):
        self.source, self.split = source, split

    def __len__(self) -> int:
        return len(self.source.targets[self.split])

    def __getitem__(self, item: tuple[int, int]) -> torch.Tensor:
        i, epoch = item
        return self.source.uint8_batch(self.split, np.array([i]), epoch, torch.device("cpu"))[0]


class _BatchSampler:
    """The loader's batch sampler: each announced batch as items ``(index, epoch)``, made as it is asked
    for (the batches stay index arrays, 8 bytes a sample, not a list of tuples for the whole epoch)."""

    def __init__(self, batches: list[np.ndarray], epoch: int):
        self.batches, self.epoch = batches, epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            yield [(int(i), self.epoch) for i in b]

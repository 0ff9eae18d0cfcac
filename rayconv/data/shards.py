"""Prepared shards (``python -m rayconv.prepare``) as a training source: ``--data shards``.

A prepared folder holds ``manifest.json`` and Parquet shards ``train-00000.parquet``, ...,
``val-00000.parquet``, ... with columns ``index`` (the file's position in its split's sorted listing),
``label`` (int32, position of its class in ``classes``), ``height``, ``width`` (int32, pixels) and
``jpeg`` (binary: the image re-encoded as a baseline RGB JPEG, shorter side at most ``size``), plus
``path`` (the source file, relative to the source folder). Sample ``k`` of a split is row ``k`` of its
shards taken in order.

Checks: the manifest must list exactly the shard files present, each with its byte size (checked when
the source opens) and sha256 (checked on the bytes an actor loads), else DataError names the file.

Memory: an actor that feeds the first pipeline stage holds the ``jpeg`` column of both splits in
memory (about the folder's size on disk; the files are memory-mapped while read, so actors of one
node share their page cache). Other actors read the ``label`` column only.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from rayconv.data import decode as dec
from rayconv.data.augment import erase, erase_params
from rayconv.data.folders import SPLITS
from rayconv.data.on_device import pad_for
from rayconv.data.source import Source, stable_seed
from rayconv.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "rayconv-shards/1"


def is_prepared(path: Optional[str]) -> bool:
    """Whether ``path`` is a folder written by ``python -m rayconv.prepare`` (has its manifest)."""
    return bool(path) and (Path(path) / MANIFEST).is_file()


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a prepared folder, checked against the files present: every listed shard exists
    with its byte size, and no unlisted shard is there. Raises DataError naming what does not match."""
    path = root / MANIFEST
    if not path.is_file():
        raise DataError(f"{root} has no {MANIFEST}: prepare it with `python -m rayconv.prepare DIR --out {root}`")
    try:
        manifest = json.loads(path.read_text())
        assert manifest.get("format") == FORMAT, f"format {manifest.get('format')!r}, not {FORMAT!r}"
        listed = {e["file"]: e for split in SPLITS.values() for e in manifest["splits"][split]["shards"]}
    except (ValueError, AssertionError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a rayconv shard manifest ({e}): prepare the folder again") from None
    present = {p.name for p in root.glob("*.parquet")}
    for name in sorted(set(listed) - present):
        raise DataError(f"{root / name} is listed in {MANIFEST} but missing: run `python -m rayconv.prepare` "
                        f"again with --out {root} (it rewrites what is missing)")
    for name in sorted(present - set(listed)):
        raise DataError(f"{root / name} is not listed in {MANIFEST}: remove it or prepare the folder again")
    for name, entry in sorted(listed.items()):
        size = (root / name).stat().st_size
        if size != entry["bytes"]:
            raise DataError(f"{root / name} has {size} bytes, {MANIFEST} says {entry['bytes']}: run "
                            f"`python -m rayconv.prepare` again with --out {root} (it rewrites bad shards)")
    return manifest


class ShardSource(Source):
    """A prepared folder: labels read at once, JPEG bytes on first use, decoded per batch.

    ``decode``: ``gpu`` (batched nvJPEG on the actor's GPU, then crop, flip and normalise there, on a
    side CUDA stream, one batch ahead), ``cpu`` (``workers`` DataLoader processes decode with
    libjpeg-turbo, crop and flip; the actor normalises on its device) or ``auto`` (cpu: on an H200 with
    14 workers, ResNet-50 at batch 256 trained at 0.98x its synthetic-data rate with cpu, 0.58x with gpu,
    whose decode and crops take GPU time from the model; benchmarks/RESULTS.md). Raises DataError for
    a folder whose manifest does not match its files.

    Overlap on GPUs: when batch k is taken, batch k + 1 is decoded and cropped on a side stream; the
    caller's stream waits on an event before using batch k. torchvision's batched nvJPEG call returns
    when its decode is done (it synchronises its own stream; baseline JPEGs, as prepare writes, go to
    the hardware JPEG decoder of A100/H100-class GPUs), so the actor's thread spends that time before
    it launches step k, while step k - 1 still runs on the GPU."""

    def __init__(self, root: str, image_size: int, seed: int, workers: int, decode: str = "auto",
                 augment: str = "resized-crop", random_erase: float = 0.0):
        import pyarrow.parquet as pq

        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.classes = list(self.manifest["classes"])
        self.num_classes = len(self.classes)
        self.sample_shape = (3, image_size, image_size)
        self.size, self.seed, self.workers, self.decode = image_size, seed, workers, decode
        self.augment, self.random_erase, self.name = augment, random_erase, "shards"
        self.augmentation = {"resized-crop": "RandomResizedCrop(0.08-1) + flip",
                             "pad-crop": f"center crop, pad {pad_for(image_size)} + random crop + flip",
                             "none": "center crop"}[augment] \
            + (f", random erasing p={random_erase:g}" if random_erase > 0 else "") + f" (decode {decode})"
        self.entries = {s: self.manifest["splits"][f]["shards"] for s, f in SPLITS.items()}
        self.targets: dict[str, torch.Tensor] = {}
        self.hw: dict[str, np.ndarray] = {}
        for split, entries in self.entries.items():
            tables = [pq.read_table(self.root / e["file"], columns=["label", "height", "width"]) for e in entries]
            col = lambda name: np.concatenate([t.column(name).to_numpy() for t in tables]) if tables \
                else np.zeros(0, np.int32)  # noqa: E731
            self.targets[split] = torch.from_numpy(col("label").astype(np.int64))
            self.hw[split] = np.stack([col("height"), col("width")], axis=1)
        self.train_size, self.test_size = len(self.targets["train"]), len(self.targets["test"])
        if self.train_size == 0 or self.test_size == 0:
            raise DataError(f"{self.root} holds {self.train_size} train and {self.test_size} val images: "
                            "both splits need images")
        self._bytes: dict[str, tuple[list, np.ndarray]] = {}
        self._pending: dict[str, dict[str, Any]] = {}
        self._stream: Optional[torch.cuda.Stream] = None
        # GPU decode runs on a thread of its own: nvJPEG holds the calling thread until its batch is
        # decoded, so the actor's thread launches the step while the next batch decodes.
        self._decoder: Optional[ThreadPoolExecutor] = None

    # ------------------------------------------------------------------ bytes
    def _load(self, split: str) -> tuple[list, np.ndarray]:
        """Every shard's (data, offsets) of the ``jpeg`` column, and the first row of each shard."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if split not in self._bytes:
            parts, starts = [], [0]
            for e in self.entries[split]:
                path = self.root / e["file"]
                with pa.memory_map(str(path)) as f:
                    buf = f.read_buffer()
                    if hashlib.sha256(memoryview(buf)).hexdigest() != e["sha256"]:
                        raise DataError(f"{path}: sha256 does not match {MANIFEST}: run `python -m rayconv."
                                        f"prepare` again with --out {self.root} (it rewrites bad shards)")
                    col = pq.read_table(pa.BufferReader(buf), columns=["jpeg"]).column("jpeg").combine_chunks()
                _, offsets, data = col.buffers()
                off = np.frombuffer(offsets, dtype=np.int32)[col.offset:col.offset + len(col) + 1]
                parts.append((np.frombuffer(data, dtype=np.uint8), off, col))
                starts.append(starts[-1] + len(col))
            self._bytes[split] = (parts, np.asarray(starts))
        return self._bytes[split]

    def jpegs(self, split: str, idx: np.ndarray) -> list[torch.Tensor]:
        """The JPEG bytes of samples ``idx`` of ``split``: 1-D uint8 CPU tensors (views of one copy)."""
        parts, starts = self._load(split)
        shard = np.searchsorted(starts, idx, side="right") - 1
        pieces = []
        for s, i in zip(shard, idx):
            data, off, _ = parts[s]
            r = int(i) - int(starts[s])
            pieces.append(data[off[r]:off[r + 1]])
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
        return dec.transform(dec.decode(self.jpegs(split, idx), device), self.size, self.params(split, epoch, idx),
                             self.augment)

    # ------------------------------------------------------------------ Source
    def _use_gpu(self, device: torch.device) -> bool:
        if self.decode == "gpu" and device.type != "cuda":
            raise DataError("--decode gpu decodes on the actor's GPU: use --device cuda or --decode cpu")
        return device.type == "cuda" and self.decode == "gpu"

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Announce this actor's next batches of ``split``: CPU decode starts them in the loader's
        workers; GPU decode launches each when the one before it is taken."""
        batches = [np.asarray(b) for b in batches if len(b)]
        self._pending[split] = {"epoch": epoch, "queue": deque(batches), "loader": None, "launched": None}

    def images(self, split, idx, device, epoch=0, dtype=None):
        device = torch.device(device)
        if len(idx) == 0:
            return torch.empty((0, *self.sample_shape), device=device, dtype=dtype or torch.float32)
        pending = self._pending.get(split)   # one announced sequence per split: evaluation keeps training's
        if pending is None or pending["epoch"] != epoch or not pending["queue"] \
                or not np.array_equal(pending["queue"][0], idx):
            self.prefetch(split, epoch, [idx])          # not announced: decode this batch alone
            pending = self._pending[split]
        x = self._take_gpu(split, pending, device) if self._use_gpu(device) else self._take_cpu(split, pending)
        if not pending["queue"]:
            self._pending.pop(split, None)   # the last announced batch: the loader and its workers go with it
        x = dec.normalize(x.to(device, non_blocking=True), dtype)
        return self._erase(x, epoch, idx) if split == "train" and self.random_erase > 0 else x

    def _erase(self, x: torch.Tensor, epoch: int, idx: np.ndarray) -> torch.Tensor:
        """``x`` with each sample's RandomErasing rectangle (``augment.erase_params``, from (seed, epoch,
        index) alone) set to 0."""
        boxes = torch.cat([erase_params(1, self.size, self.size, self.random_erase,
                                        torch.Generator().manual_seed(stable_seed(self.seed, "erase", epoch, int(i))))
                           for i in idx])
        boxes = boxes.pin_memory().to(x.device, non_blocking=True) if x.is_cuda else boxes
        return erase(x, boxes)

    def _take_gpu(self, split: str, pending: dict, device: torch.device) -> torch.Tensor:
        """This batch (launched ahead, or now), after handing the next one to the decode thread."""
        idx = pending["queue"].popleft()
        launched: Optional[Future] = pending["launched"]
        current = launched.result() if launched is not None else self._launch(split, pending["epoch"], idx, device)
        if pending["queue"]:
            if self._decoder is None:
                self._decoder = ThreadPoolExecutor(1, thread_name_prefix="rayconv-decode")
            pending["launched"] = self._decoder.submit(self._launch, split, pending["epoch"], pending["queue"][0],
                                                       device)
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
            except RuntimeError as e:   # nvJPEG's error on bytes that passed the sha256 check
                raise DataError(f"cannot decode a sample of {self.root} on {device} ({e}): prepare the "
                                "folder again, or use --decode cpu") from None
            event = torch.cuda.Event()
            event.record(self._stream)
        return x, event

    def _take_cpu(self, split: str, pending: dict) -> torch.Tensor:
        if pending["loader"] is None:
            self._load(split)  # before the workers fork: they share the bytes
            plan = [[(int(i), pending["epoch"]) for i in b] for b in pending["queue"]]
            workers = self.workers
            loader = DataLoader(_Samples(self, split), batch_sampler=plan, num_workers=workers,
                                generator=torch.Generator(), prefetch_factor=2 if workers else None,
                                multiprocessing_context="fork" if workers else None,
                                pin_memory=torch.cuda.is_available())
            pending["loader"] = iter(loader)
        pending["queue"].popleft()
        try:
            return next(pending["loader"])
        except RuntimeError as e:
            lines = str(e).strip().splitlines()
            raise DataError(f"cannot decode a sample of {self.root} ({lines[-1] if lines else e}): "
                            "prepare the folder again") from None

    def labels(self, split, idx):
        return self.targets[split][torch.as_tensor(idx, dtype=torch.long)]


class _Samples(Dataset):
    """One sample per item ``(index, epoch)``: decoded on the CPU, cropped and flipped, uint8 (3, S, S)."""

    def __init__(self, source: ShardSource, split: str):
        self.source, self.split = source, split

    def __len__(self) -> int:
        return len(self.source.targets[self.split])

    def __getitem__(self, item: tuple[int, int]) -> torch.Tensor:
        i, epoch = item
        return self.source.uint8_batch(self.split, np.array([i]), epoch, torch.device("cpu"))[0]

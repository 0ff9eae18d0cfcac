"""Data sources and the deterministic sharding of each global batch over data-parallel replicas.

Sources (``--data``):

* ``digits``: the 1,797 real 8x8 handwritten-digit scans that ship inside scikit-learn (UCI optdigits
  test set), 10 classes; a fixed 80/20 split gives 1,437 train and 360 held-out images. No download.
* ``imagefolder``: an ImageNet-layout folder, ``<dir>/train/<class>/<images>`` and ``<dir>/val/<class>/...``
  (JPEG, PNG and the other formats of torchvision's ImageFolder; names starting with a dot are skipped),
  decoded and augmented by torchvision (RandomResizedCrop + flip for training; resize + center crop for
  evaluation), read by a ``torch.utils.data.DataLoader`` with worker processes.
* ``shards``: a folder written by ``python -m rayconv.prepare`` (Parquet shards of training-size JPEGs),
  decoded on the GPU or the CPU (``rayconv/shards.py``, ``rayconv/decode.py``).
* ``synthetic``: ImageNet-shaped images (3 x S x S, 1000 classes) made directly on the device, for
  throughput; labels are a fixed function of the sample index.

Sharding: the train set is permuted once per epoch from (seed, epoch); global step ``s`` of the epoch
takes the next ``global_batch_size`` samples (the last batch of an epoch may be smaller); replica ``r``
takes its contiguous slice of that batch, slices as even as possible (sizes differ by at most 1).
Every actor computes the same indices alone, so data never passes through the driver. Gradients are
weighted by sample count (loss summed over samples and divided by the global count), so uneven
slices stay exact.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from rayconv.config import Config, ConfigError
from rayconv.errors import DataError
from rayconv.mesh import split_slices

# torchvision's ImageFolder suffixes (torchvision.datasets.folder.IMG_EXTENSIONS; tests/unit/test_units.py
# checks they are the same). Written out so that importing this module does not import torchvision.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def stable_seed(*parts: object) -> int:
    """A 31-bit seed from ints and strings, the same in every process (unlike ``hash`` of a str)."""
    import zlib

    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


@dataclass(frozen=True)
class Sharding:
    """Which train samples each replica reads at each step.

    ``train_size`` samples, ``global_batch_size`` per step, ``dp`` replicas; ``steps_per_epoch`` counts
    the last partial batch.
    """

    train_size: int
    global_batch_size: int
    dp: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.train_size // self.global_batch_size)

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The epoch's sample order (computed once per epoch: ImageNet's is 1.28 M long)."""
        cached = self.__dict__.get("_perm")
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(self.train_size))
            object.__setattr__(self, "_perm", cached)
        return cached[1]

    def global_batch(self, epoch: int, step_in_epoch: int) -> np.ndarray:
        """Sample indices of the whole global batch, shape (B,), B <= global_batch_size."""
        start = step_in_epoch * self.global_batch_size
        return self.epoch_permutation(epoch)[start:start + self.global_batch_size]

    def replica_batch(self, epoch: int, step_in_epoch: int, replica: int) -> tuple[np.ndarray, int]:
        """(this replica's sample indices, number of samples in the global batch)."""
        batch = self.global_batch(epoch, step_in_epoch)
        return batch[split_slices(len(batch), self.dp)[replica]], len(batch)


def test_shard(test_size: int, dp: int, replica: int) -> np.ndarray:
    """Held-out indices evaluated by ``replica``: every sample exactly once over all replicas."""
    return np.arange(test_size)[split_slices(test_size, dp)[replica]]


# ---------------------------------------------------------------------- sources
class Source:
    """Train and test data of one kind, as seen by one actor.

    ``num_classes``; ``sample_shape`` (C, H, W); ``train_size`` and ``test_size`` in samples.
    ``images(split, idx, device, epoch, dtype)`` -> float tensor (len(idx), C, H, W) of ``dtype`` (float32 when
    None); ``labels(split, idx)`` -> int64 (len(idx),).
    """

    num_classes: int
    sample_shape: tuple[int, int, int]
    train_size: int
    test_size: int

    def images(self, split: str, idx: np.ndarray, device: torch.device, epoch: int = 0,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError

    def labels(self, split: str, idx: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Announce the batches ``images`` will be asked for next (sources that decode files start now)."""


class TensorSource(Source):
    """A data set held in memory as tensors (digits)."""

    def __init__(self, train: TensorDataset, test: TensorDataset, num_classes: int):
        self.sets = {"train": train, "test": test}
        self.num_classes = num_classes
        self.sample_shape = tuple(train.tensors[0].shape[1:])  # type: ignore[assignment]
        self.train_size, self.test_size = len(train), len(test)

    def images(self, split, idx, device, epoch=0, dtype=None):
        x = self.sets[split].tensors[0][torch.as_tensor(idx, dtype=torch.long)]
        x = x.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else x
        return x if dtype is None else x.to(dtype)

    def labels(self, split, idx):
        return self.sets[split].tensors[1][torch.as_tensor(idx, dtype=torch.long)]


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits: images (N, 8, 8) float64 in 0..16 and targets (N,) int64, as
    ``sklearn.datasets.load_digits`` returns them.

    Read from the file that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and
    the target per row) without importing scikit-learn, whose import takes over a second of CPU in each
    actor; ``load_digits`` itself where that file is not found. ``tests/unit/test_units.py`` checks both agree."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as _load

        d = _load()
        return d.images, d.target.astype(np.int64)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def load_digits(seed: int = 0) -> TensorSource:
    """scikit-learn's digits: (N, 1, 8, 8) float32, pixel values scaled to mean 0, std 1; 10 classes."""
    images, targets = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0     # x_N1HW in [0, 1]
    x = (x - 0.3) / 0.4                                                   # roughly mean 0, std 1
    y = torch.tensor(targets, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))  # fixed split, not --seed
    n_test = len(x) // 5
    te, tr = perm[:n_test], perm[n_test:]
    return TensorSource(TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te]), num_classes=10)


class SyntheticSource(Source):
    """ImageNet-shaped synthetic data generated on the device (no host-to-device copy)."""

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

    def labels(self, split, idx):
        offset = 0 if split == "train" else 7
        return torch.as_tensor((np.asarray(idx, dtype=np.int64) * 7919 + offset) % self.num_classes)


def hidden(name: str) -> bool:
    """Folders and files whose names start with a dot (``.thumbnails``, macOS's ``._x.jpg``) are not
    data: neither classes nor images."""
    return name.startswith(".")


def _visible_image_folder(root: str, transform):
    """torchvision's ImageFolder that skips hidden folders and files (``hidden``) at every level."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import has_file_allowed_extension

    class VisibleImageFolder(ImageFolder):
        def find_classes(self, directory):
            classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not hidden(e.name))
            if not classes:
                raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
            return classes, {c: i for i, c in enumerate(classes)}

        @staticmethod
        def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
            def visible_image(path: str) -> bool:
                return (has_file_allowed_extension(path, extensions or IMAGE_SUFFIXES)
                        and not any(hidden(part) for part in Path(path).relative_to(directory).parts))

            return ImageFolder.make_dataset(directory, class_to_idx, None, visible_image, allow_empty)

    return VisibleImageFolder(root, transform=transform)


class _CheckedImageFolder(Dataset):
    """torchvision ImageFolder whose decode errors name the file and what to do."""

    def __init__(self, root: Path, transform):
        try:
            self.inner = _visible_image_folder(str(root), transform)
        except FileNotFoundError as e:  # a class folder without image files
            raise DataError(f"data folder {root}: {e}: put images in every class folder or remove the empty ones") \
                from None
        self.targets = torch.tensor(self.inner.targets, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, item: tuple[int, int]):
        """``item`` = (sample index, augmentation seed): the random crop and flip of a sample depend only
        on its seed, not on which loader process decodes it or what else is in its batch."""
        i, seed = item
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return self.inner[i]
        except Exception as e:  # PIL.UnidentifiedImageError, OSError for truncated files, ...
            path = self.inner.samples[i][0]
            raise DataError(f"cannot decode image {path} ({type(e).__name__}: {e}): "
                            "remove or replace that file") from None


class ImageFolderSource(Source):
    """An ImageNet-layout folder read through torchvision's ImageFolder and a DataLoader."""

    def __init__(self, root: str, image_size: int, seed: int, workers: int):
        from torchvision.transforms import v2 as T

        base = Path(root)
        for split in ("train", "val"):
            check_image_folder(base / split)
        norm = [T.ToImage(), T.ToDtype(torch.float32, scale=True),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
        self.sets = {
            "train": _CheckedImageFolder(base / "train", T.Compose(
                [T.RandomResizedCrop(image_size, antialias=True), T.RandomHorizontalFlip(), *norm])),
            "test": _CheckedImageFolder(base / "val", T.Compose(
                [T.Resize(image_size * 8 // 7, antialias=True), T.CenterCrop(image_size), *norm])),
        }
        train_classes = self.sets["train"].inner.classes
        if self.sets["test"].inner.classes != train_classes:
            raise DataError(f"{base}/val has classes {self.sets['test'].inner.classes[:5]}... but train has "
                            f"{train_classes[:5]}...: both need the same class folders")
        self.num_classes = len(train_classes)
        self.sample_shape = (3, image_size, image_size)
        self.train_size, self.test_size = len(self.sets["train"]), len(self.sets["test"])
        from rayconv.prepare import warn_skipped  # (it imports this module)

        self.skipped = sum(warn_skipped(base / split) for split in ("train", "val"))
        self.seed, self.workers = seed, workers
        self._pending: dict[str, tuple] = {}

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Start decoding ``batches`` (this actor's, in the order it will ask for them) in
        ``workers`` background processes; ``images`` then takes them in turn."""
        ds = self.sets[split]
        plan = [[(int(i), stable_seed(self.seed, split, epoch, int(i))) for i in b] for b in batches if len(b)]
        # (Its own generator: creating the iterator must not draw from the global torch RNG.)
        loader = DataLoader(ds, batch_sampler=plan, num_workers=self.workers, generator=torch.Generator(),
                            prefetch_factor=2 if self.workers else None, pin_memory=torch.cuda.is_available())
        self._pending[split] = (epoch, [np.asarray(b) for b in batches if len(b)], iter(loader))

    def images(self, split, idx, device, epoch=0, dtype=None):
        if len(idx) == 0:
            return torch.empty((0, *self.sample_shape), device=device, dtype=dtype or torch.float32)
        pending = self._pending.get(split)   # one announced sequence per split: evaluation keeps training's
        if pending is None or pending[0] != epoch or not pending[1] or not np.array_equal(pending[1][0], idx):
            self.prefetch(split, epoch, [idx])          # not announced: decode this batch alone
            pending = self._pending[split]
        pending[1].pop(0)
        if not pending[1]:
            del self._pending[split]  # the last announced batch: the loader and its workers go with it
        try:
            x, _ = next(pending[2])
        except DataError as e:
            # A worker's error comes back as "Caught DataError in DataLoader worker ...\n<traceback>":
            # keep the one line that names the file.
            msg = str(e).strip().splitlines()
            raise DataError(msg[-1].split("DataError: ", 1)[-1] if len(msg) > 1 else str(e)) from None
        x = x.to(device, non_blocking=True)
        return x if dtype is None else x.to(dtype)

    def labels(self, split, idx):
        return self.sets[split].targets[torch.as_tensor(idx, dtype=torch.long)]


def check_image_folder(path: Path) -> None:
    """Raise DataError unless ``path`` holds class folders with at least one image file (hidden
    folders and files, ``hidden``, do not count)."""
    if not path.is_dir():
        raise DataError(f"data folder {path} does not exist: --data-dir must hold train/<class>/<images> "
                        f"and val/<class>/<images> ({', '.join(IMAGE_SUFFIXES)})")
    classes = [p for p in path.iterdir() if p.is_dir() and not hidden(p.name)]
    if not classes:
        raise DataError(f"data folder {path} has no class folders: put images in {path}/<class>/")
    if not any(f.suffix.lower() in IMAGE_SUFFIXES and not hidden(f.name) for c in classes for f in c.iterdir()):
        raise DataError(f"data folder {path} has class folders but no image files "
                        f"({', '.join(IMAGE_SUFFIXES)})")


def loader_workers(cfg: Config) -> int:
    """Decode processes per actor: ``--loader-workers``, or by default on GPUs this node's CPU cores per
    GPU less 2 (one for the actor, one spare), at least 2; on CPUs 2 (the actors use the cores)."""
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return 2
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, cores // max(1, torch.cuda.device_count()) - 2)


def make_source(cfg: Config, num_classes: Optional[int] = None) -> Source:
    """The data source named by ``cfg.data``. Raises DataError / ConfigError."""
    if cfg.data == "digits":
        src: Source = load_digits()
    elif cfg.data == "synthetic":
        src = SyntheticSource(cfg.image_size, cfg.num_classes or 1000, cfg.synthetic_samples, cfg.seed)
    elif cfg.data in ("imagefolder", "shards"):
        from rayconv.data.shards import ShardSource, is_prepared  # (it imports this module)

        if cfg.data == "shards" or is_prepared(cfg.data_dir):  # a prepared folder is read as shards
            src = ShardSource(cfg.data_dir or "", cfg.image_size, cfg.seed, loader_workers(cfg), cfg.decode)
        else:
            src = ImageFolderSource(cfg.data_dir or "", cfg.image_size, cfg.seed, loader_workers(cfg))
    else:
        raise ConfigError(f"unknown --data {cfg.data!r}")
    if cfg.num_classes is not None and cfg.num_classes != src.num_classes:
        raise ConfigError(f"--num-classes {cfg.num_classes} but --data {cfg.data} has {src.num_classes} classes: "
                          "drop --num-classes (it follows the data)")
    return src

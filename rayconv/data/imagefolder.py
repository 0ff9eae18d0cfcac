"""``--data imagefolder``: an ImageNet-layout folder (``rayconv/data/folders.py`` says what it holds),
decoded and augmented by torchvision's ``transforms.v2`` in the loader's processes, read by a
``torch.utils.data.DataLoader`` with worker processes. Training (``augment``): ``resized-crop``
(RandomResizedCrop + flip), ``pad-crop`` (resize + center crop, then RandomCrop padded by
``on_device.pad_for(S)`` + flip) or ``none`` (resize + center crop, as evaluation); then ``auto_augment``'s
policy per image (``rayconv/data/auto_augment.py``); then, with
``random_erase`` > 0, ``RandomErasing(p, value=0)`` after the normalisation. Evaluation: resize +
center crop."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from rayconv.data import auto_augment as aa
from rayconv.data.folders import (IMAGE_SUFFIXES, check_image_folder, empty_class_folders,
                                  visible_image_folder, warn_skipped)
from rayconv.data.on_device import pad_for
from rayconv.data.source import Source, stable_seed
from rayconv.errors import DataError


class CheckedImageFolder(Dataset):
    """torchvision ImageFolder whose decode errors name the file and what to do."""

    def __init__(self, root: Path, transform):
        try:
            self.inner = visible_image_folder(str(root), transform)
        except FileNotFoundError:  # a class folder without image files (or no class folder)
            empty = empty_class_folders(Path(root))
            names = f"class folder{'s' * (len(empty) > 1)} {', '.join(empty[:5])}"
            what = (
                f"{names} {'hold' if len(empty) > 1 else 'has'} no image files ({', '.join(IMAGE_SUFFIXES)})"
                if empty
                else "no class folders with image files"
            )
            raise DataError(
                f"data folder {root}: {what}: put images in every class folder or remove the empty "
                "ones") from None
        self.targets = torch.tensor(self.inner.targets, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, item: tuple[int, int]):
        """``item`` = (sample index, augmentation seed): the random crop and flip of a sample depend only
        on its seed, not on which loader process decodes it or what else is in its batch."""
        i, seed = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.load(i)

    def load(self, i: int):
        """Sample ``i`` (image, label) through the transform, drawing from the global RNG as it is (for
        deterministic transforms: no seeding, whose ``torch.manual_seed`` also seeds every GPU and costs
        more than a small image's decode). Raises DataError naming a file that does not decode."""
        try:
            return self.inner[i]
        except Exception as e:  # PIL.UnidentifiedImageError, OSError for truncated files, ...
            path = self.inner.samples[i][0]
            raise DataError(f"cannot decode image {path} ({type(e).__name__}: {e}): "
                            "remove or replace that file") from None


def center_transforms(image_size: int) -> list:
    """The evaluation's crop of a PIL image, before its tensor conversion: the shorter side resized to
    ``image_size * 8 // 7`` (antialiased), then the center ``image_size`` x ``image_size``."""
    from torchvision.transforms import v2 as T   # (torchvision's import takes seconds: only when used)

    return [T.Resize(image_size * 8 // 7, antialias=True), T.CenterCrop(image_size)]


class ImageFolderSource(Source):
    """An ImageNet-layout folder read through torchvision's ImageFolder and a DataLoader.

    Raises DataError for a folder without classes or images, or val classes other than train's."""

    def __init__(self, root: str, image_size: int, seed: int, workers: int, augment: str = "resized-crop",
                 random_erase: float = 0.0, auto_augment: Optional[str] = None):
        from torchvision.transforms import v2 as T   # (torchvision's import takes seconds: only when used)

        base = Path(root)
        for split in ("train", "val"):
            check_image_folder(base / split)
        norm = [T.ToImage(), T.ToDtype(torch.float32, scale=True),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
        center = center_transforms(image_size)
        pad = pad_for(image_size)
        train = {"resized-crop": [T.RandomResizedCrop(image_size, antialias=True), T.RandomHorizontalFlip()],
                 "pad-crop": [*center, T.RandomCrop(image_size, padding=pad), T.RandomHorizontalFlip()],
                 "none": center}[augment]
        erase = [T.RandomErasing(random_erase, value=0)] if random_erase > 0 else []
        policy = [aa.make_transform(auto_augment)] if auto_augment else []
        self.sets = {
            "train": CheckedImageFolder(base / "train", T.Compose([*train, *policy, *norm, *erase])),
            "test": CheckedImageFolder(base / "val", T.Compose([*center, *norm])),
        }
        self.name = "imagefolder"
        self.augmentation = {"resized-crop": "RandomResizedCrop(0.08-1) + flip",
                             "pad-crop": f"resize + center crop, pad {pad} + random crop + flip",
                             "none": "resize + center crop"}[augment] \
            + (f", auto-augment {auto_augment}" if auto_augment else "") \
            + (f", random erasing p={random_erase:g}" if random_erase > 0 else "") + " (in the loader)"
        train_classes = self.sets["train"].inner.classes
        if self.sets["test"].inner.classes != train_classes:
            raise DataError(f"{base}/val has classes {self.sets['test'].inner.classes[:5]}... but train has "
                            f"{train_classes[:5]}...: both need the same class folders")
        self.num_classes = len(train_classes)
        self.sample_shape = (3, image_size, image_size)
        self.train_size, self.test_size = len(self.sets["train"]), len(self.sets["test"])
        self.skipped = sum(warn_skipped(base / split) for split in ("train", "val"))
        self.seed, self.workers = seed, workers
        self._pending: dict[str, tuple] = {}

    def prefetch(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Start decoding ``batches`` (this actor's, in the order it will ask for them) in
        ``workers`` background processes; ``images`` then takes them in turn."""
        ds = self.sets[split]
        sampler = [[(int(i), stable_seed(self.seed, split, epoch, int(i))) for i in b] for b in batches
                   if len(b)]
        # (Its own generator: creating the iterator must not draw from the global torch RNG.)
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=self.workers, generator=torch.Generator(),
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
            named = msg[-1].split("DataError: ", 1)[-1] if len(msg) > 1 else str(e)
        else:
            x = x.to(device, non_blocking=True)
            return x if dtype is None else x.to(dtype)
        # (raised outside the except clause, so that no traceback holds the loader: its workers stop
        # now, not at a later garbage collection)
        self._pending.pop(split, None)
        del pending
        raise DataError(named)

    def labels(self, split, idx):
        return self.sets[split].targets[torch.as_tensor(idx, dtype=torch.long)]

    def add_val_split(self) -> None:
        """"val": the train folder's listing with the test split's transform (resize + center crop)."""
        val = copy.copy(self.sets["train"])
        val.inner = copy.copy(val.inner)
        val.inner.transform = self.sets["test"].inner.transform
        self.sets["val"] = val

"""``--data fashion-mnist``: Zalando's Fashion-MNIST (Xiao et al. 2017), 28x28 grayscale images of 10
kinds of clothing, its own split of 60,000 train and 10,000 test images (6,000 and 1,000 per class).

Read from the four idx files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each plain or gzipped) in ``--data-dir``, or
where Debian's package ``dataset-fashion-mnist`` installs them. Held on the device as uint8
(``rayconv/data/on_device.py``), resized there once to ``--image-size`` when given; by default
(``--augment auto`` at 28 pixels: pad-crop) training samples are zero-padded by 4 pixels, randomly
cropped back to 28x28 and randomly mirrored (the CIFAR recipe of He et al. 2016, section 4.2); all
images normalised by the train set's mean and std.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Optional

import numpy as np

from rayconv.data.on_device import OnDeviceSource
from rayconv.errors import DataError

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"   # where `apt-get install dataset-fashion-mnist` puts them
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IMAGE_MAGIC, LABEL_MAGIC = 0x0803, 0x0801   # idx: unsigned bytes, 3 dims (images) or 1 (labels)
PAD = 4   # pixels of the 28x28 training crop's zero padding (on_device.pad_for(28))


def _find(folder: Path, name: str) -> Optional[Path]:
    """``folder/name`` or ``folder/name.gz``, whichever exists."""
    for path in (folder / name, folder / (name + ".gz")):
        if path.is_file():
            return path
    return None


def read_idx(path: Path, magic: int) -> np.ndarray:
    """The uint8 array of one idx file (plain or gzipped): (N, H, W) for images, (N,) for labels.
    Raises DataError for a file of another type or a size its header does not give."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = bytearray(f.read())   # writable, so that torch.from_numpy can share it
    except OSError as e:
        raise DataError(f"cannot read {path} ({e}): replace it (apt-get install --reinstall "
                        "dataset-fashion-mnist) or give --data-dir DIR with good copies") from None
    ndim = magic & 0xFF
    head = 4 + 4 * ndim
    found = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)] if len(data) >= head else []
    if found != magic or len(data) != head + int(np.prod(dims or [-1])):
        raise DataError(f"{path} is not an idx file of {ndim}-dimensional uint8 data (magic {magic:#06x}) of "
                        "the size its header gives: replace it with the Fashion-MNIST original")
    return np.frombuffer(data, dtype=np.uint8, offset=head).reshape(dims)


def fashion_mnist_arrays(data_dir: Optional[str] = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train": (images (60000, 1, 28, 28) uint8, labels (60000,) int64), "test": (10000 of each)} from
    ``data_dir`` or Debian's folder. Raises DataError (one line) when a file is missing or malformed."""
    folder = Path(data_dir or DEBIAN_DIR)
    paths = {name: _find(folder, name) for pair in FILES.values() for name in pair}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        raise DataError(f"--data fashion-mnist: {folder} lacks {', '.join(missing)} (or .gz): install them with "
                        "`apt-get install dataset-fashion-mnist`, or give --data-dir DIR holding the four idx files")
    out = {}
    for split, (images, labels) in FILES.items():
        x = read_idx(paths[images], IMAGE_MAGIC)[:, None]                   # (N, 1, 28, 28)
        y = read_idx(paths[labels], LABEL_MAGIC).astype(np.int64)           # (N,)
        if len(x) != len(y) or (len(y) and int(y.max()) >= 10):
            raise DataError(f"{paths[images]} holds {len(x)} images but {paths[labels]} {len(y)} labels in 0..9 "
                            f"(largest {int(y.max()) if len(y) else None}): replace them with the Fashion-MNIST originals")
        out[split] = (x, y)
    return out


def load_fashion_mnist(data_dir: Optional[str], seed: int, image_size: Optional[int] = None,
                       augment: str = "pad-crop", random_erase: float = 0.0,
                       auto_augment: Optional[str] = None) -> OnDeviceSource:
    """Fashion-MNIST as a Source held on the device: 1 channel, 28x28 (``image_size``: resized once on
    the device), 10 classes; training samples augmented by ``augment`` (pad-crop: padded by
    ``on_device.pad_for(S)``, ``PAD`` at 28, and mirrored), given ``auto_augment``'s policy and erased with probability ``random_erase``,
    keyed by (``seed``, epoch, sample). Raises DataError when the files are missing or malformed."""
    arrays = fashion_mnist_arrays(data_dir)
    size = None if image_size in (None, 28) else image_size
    return OnDeviceSource(arrays["train"], arrays["test"], num_classes=10, seed=seed, image_size=size,
                          augment=augment, random_erase=random_erase, name="fashion-mnist",
                          auto_augment=auto_augment)

"""``--data fashion-mnist``: Zalando's Fashion-MNIST (Xiao et al. 2017), 28x28 grayscale images of 10
kinds of clothing, its own split of 60,000 train and 10,000 test images (6,000 and 1,000 per class).

Read from the four idx files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each plain or gzipped) in ``--data-dir``, or
where Debian's package ``dataset-fashion-mnist`` installs them. Held on the device as uint8
(``rayconv/data/on_device.py``), resized there once to ``--image-size`` when given; by default
(``--augment auto`` at 28 pixels: pad-crop) training samples are zero-padded by 4 pixels, randomly
cropped back to 28x28 and randomly mirrored (the CIFAR recipe of He et al. 2016, section 4.2); all
images normalised by the train set's mean and std.

The driver's checks see the files as ``HeaderSource`` (``registry.check_source``): the sizes and image
shape from the image files' idx headers and sizes (a gzipped file's as its gzip trailer records it), the
labels read and checked; no image file is decompressed there. The actors read the four files whole
(``read_ahead``, ``load_fashion_mnist``), and refuse a gzipped image file damaged inside without a change
of size, which only decompressing shows.
"""

from __future__ import annotations

import gzip
import os
import threading
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from rayconv.data.on_device import OnDeviceSource, augmentation_of, channel_stats
from rayconv.data.source import Source
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


def _header(data: bytes, magic: int) -> tuple[list[int], int]:
    """(dims, the file's size in bytes uncompressed) that ``data`` (an idx file's first bytes) gives; size
    -1 when ``data`` is not an idx header of ``magic``."""
    ndim = magic & 0xFF
    head = 4 + 4 * ndim
    if len(data) < head or int.from_bytes(data[:4], "big") != magic:
        return [], -1
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return dims, head + int(np.prod(dims))


def read_idx(path: Path, magic: int) -> np.ndarray:
    """The uint8 array of one idx file (plain or gzipped): (N, H, W) for images, (N,) for labels.
    Raises DataError for a file of another type or a size its header does not give."""
    try:
        # (one read and one decompress call, each without the interpreter's lock: a read-ahead thread
        # does not wait on the imports running beside it chunk by chunk)
        raw = path.read_bytes()
        # writable: torch.from_numpy shares it
        data = bytearray(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {path} ({e}): replace it (apt-get install --reinstall "
                        "dataset-fashion-mnist) or give --data-dir DIR with good copies") from None
    dims, size = _header(bytes(data[:16]), magic)
    if size != len(data):
        raise DataError(f"{path} is not an idx file of {magic & 0xFF}-dimensional uint8 data (magic "
                        f"{magic:#06x}) of the size its header gives: replace it with the Fashion-MNIST "
                        "original")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims)).reshape(dims)


def idx_dims(path: Path, magic: int) -> list[int]:
    """The dims of one idx file (plain or gzipped) from its header, checked against the file's size (a
    gzipped file's as its gzip trailer records it, mod 2**32) without reading the data; a file whose
    header or size is not right is read whole (``read_idx``), which raises its DataError."""
    gz = path.suffix == ".gz"
    try:
        with (gzip.open if gz else open)(path, "rb") as f:
            dims, size = _header(f.read(16), magic)
        with open(path, "rb") as f:
            f.seek(-4 if gz else 0, os.SEEK_END)
            on_disk = int.from_bytes(f.read(4), "little") if gz else f.tell()
    except (OSError, EOFError, zlib.error):
        dims, size, on_disk = [], -1, -1
    if size >= 0 and on_disk == (size % 2**32 if gz else size):
        return dims
    return list(read_idx(path, magic).shape)


# The files read last in this process, by their identity (path, inode, size, modification time), with the
# train images' channel statistics: an actor reads them on a thread while it imports (``read_ahead``), and
# its build then finds them read. One entry: a process trains on one data set at a time.
_READ: dict[tuple, tuple[dict[str, tuple[np.ndarray, np.ndarray]], tuple[list[float], list[float]]]] = {}
_READ_LOCK = threading.Lock()   # (a build that asks while the read-ahead reads waits for it: one read)


def _paths(data_dir: Optional[str]) -> dict[str, Path]:
    """Each of ``FILES``' names -> its file in ``data_dir`` or Debian's folder. Raises DataError (one line)
    when one is missing."""
    folder = Path(data_dir or DEBIAN_DIR)
    paths = {name: _find(folder, name) for pair in FILES.values() for name in pair}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        raise DataError(
            f"--data fashion-mnist: {folder} lacks {', '.join(missing)} (or .gz): install them with "
            "`apt-get install dataset-fashion-mnist`, or give --data-dir DIR holding the four idx files")
    return paths


def _check_labels(images: Path, count: int, labels: Path, y: np.ndarray) -> None:
    """Raises DataError unless ``labels``' ``y`` are one per image of ``images`` (``count``), each in 0..9."""
    if count != len(y) or (len(y) and int(y.max()) >= 10):
        raise DataError(f"{images} holds {count} images but {labels} {len(y)} labels in 0..9 (largest "
                        f"{int(y.max()) if len(y) else None}): replace them with the Fashion-MNIST originals")


def fashion_mnist_meta(data_dir: Optional[str] = None) -> dict[str, tuple[int, int, int]]:
    """{"train": (images, rows, cols), "test": (...)} of ``data_dir``'s files (or Debian's) from the image
    files' idx headers (``idx_dims``: no image file decompressed whole) and the labels files, checked as
    ``fashion_mnist_arrays`` checks them: (60000, 28, 28) and (10000, 28, 28) for the originals. Raises
    DataError as it does, but for damage inside a gzipped image file that its size does not show (the
    actors' load refuses that file)."""
    paths, out = _paths(data_dir), {}
    for split, (images, labels) in FILES.items():
        count, rows, cols = idx_dims(paths[images], IMAGE_MAGIC)
        _check_labels(paths[images], count, paths[labels], read_idx(paths[labels], LABEL_MAGIC))
        out[split] = (count, rows, cols)
    return out


def fashion_mnist_arrays(data_dir: Optional[str] = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train": (images (60000, 1, 28, 28) uint8, labels (60000,) int64), "test": (10000 of each)} from
    ``data_dir`` or Debian's folder. Raises DataError (one line) when a file is missing or malformed."""
    return _read(data_dir)[0]


def read_ahead(data_dir: Optional[str] = None) -> None:
    """Read ``data_dir``'s four files and the train images' statistics now, for a ``load_fashion_mnist``
    of the same files later in this process (an actor's thread, while its main thread imports: zlib and
    torch let go of the interpreter while they work). A failure is left for that load to report."""
    try:
        _read(data_dir)
    except Exception:  # noqa: BLE001 - load_fashion_mnist reports it
        pass


def _read(data_dir: Optional[str]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                            tuple[list[float], list[float]]]:
    """(the arrays of ``fashion_mnist_arrays``, (mean, std) of the train images), read once per set of
    files (``_READ``)."""
    paths = _paths(data_dir)
    key = tuple((str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
                for path in paths.values() for st in [os.stat(path)])
    with _READ_LOCK:
        if key not in _READ:
            out = {}
            for split, (images, labels) in FILES.items():
                x = read_idx(paths[images], IMAGE_MAGIC)[:, None]                   # (N, 1, 28, 28)
                y = read_idx(paths[labels], LABEL_MAGIC).astype(np.int64)           # (N,)
                _check_labels(paths[images], len(x), paths[labels], y)
                out[split] = (x, y)
            _READ.clear()
            _READ[key] = (out, channel_stats(out["train"][0]))
        return _READ[key]


def load_fashion_mnist(data_dir: Optional[str], seed: int, image_size: Optional[int] = None,
                       augment: str = "pad-crop", random_erase: float = 0.0,
                       auto_augment: Optional[str] = None) -> OnDeviceSource:
    """Fashion-MNIST as a Source held on the device: 1 channel, 28x28 (``image_size``: resized once on
    the device), 10 classes; training samples augmented by ``augment`` (pad-crop: padded by
    ``on_device.pad_for(S)``, ``PAD`` at 28, and mirrored), given ``auto_augment``'s policy and erased with
    probability ``random_erase``, keyed by (``seed``, epoch, sample). Raises DataError when the files are
    missing or malformed."""
    arrays, (mean, std) = _read(data_dir)
    return OnDeviceSource(arrays["train"], arrays["test"], num_classes=10, seed=seed,
                          image_size=_side(image_size),
                          augment=augment, random_erase=random_erase, name="fashion-mnist",
                          auto_augment=auto_augment, mean=mean, std=std)


def _side(image_size: Optional[int]) -> Optional[int]:
    """The side the images are resized to (None: kept at 28)."""
    return None if image_size in (None, 28) else image_size


class HeaderSource(Source):
    """Fashion-MNIST as the driver's checks see it (``registry.check_source``), given
    ``load_fashion_mnist``'s arguments: the sizes and the image shape from the idx headers
    (``fashion_mnist_meta``), the classes and the augmentation (in words) as the actors' source gives
    them; no image file decompressed. ``images`` and ``labels`` (the first batch ``--log-images`` writes)
    load the files as the actors do, when first asked. Raises DataError as ``fashion_mnist_meta``."""

    def __init__(self, data_dir: Optional[str], seed: int, image_size: Optional[int] = None,
                 augment: str = "pad-crop", random_erase: float = 0.0, auto_augment: Optional[str] = None):
        self.args = (data_dir, seed, image_size, augment, random_erase, auto_augment)
        meta = fashion_mnist_meta(data_dir)
        (self.train_size, rows, cols), self.test_size = meta["train"], meta["test"][0]
        side = _side(image_size)
        self.name, self.num_classes = "fashion-mnist", 10
        self.sample_shape = (1, rows, cols) if side is None else (1, side, side)
        self.augmentation = augmentation_of(self.sample_shape[1], augment, random_erase=random_erase,
                                            auto_augment=auto_augment)[3]
        self._val, self._loaded = False, None

    def _source(self) -> OnDeviceSource:
        if self._loaded is None:
            self._loaded = load_fashion_mnist(*self.args)
            self._loaded.set_channels(self.sample_shape[0])
            if self._val:
                self._loaded.add_val_split()
        return self._loaded

    def images(self, split, idx, device, epoch=0, dtype=None):
        return self._source().images(split, idx, device, epoch, dtype)

    def labels(self, split, idx):
        return self._source().labels(split, idx)

    def add_val_split(self) -> None:
        self._val = True

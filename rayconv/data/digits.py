"""``--data digits``: the 1,797 real 8x8 handwritten-digit scans that ship inside scikit-learn (UCI
optdigits test set), 10 classes; a fixed 80/20 split gives 1,438 train and 359 held-out images. No
download, no augmentation.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from rayconv.data.source import TensorSource


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits: images (N, 8, 8) float64 in 0..16 and targets (N,) int64, as
    ``sklearn.datasets.load_digits`` returns them.

    Read from the file that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and
    the target per row) without importing scikit-learn, whose import takes over a second of CPU in each
    actor; ``load_digits`` itself where that file is not found. ``tests/unit/test_light_imports.py``
    checks both agree."""
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
    return TensorSource(TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te]), num_classes=10,
                        name="digits")

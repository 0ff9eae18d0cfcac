"""The train set's sample order of each epoch, from (seed, epoch) alone: ``--shuffle exact|block``.

``ExactOrder``: one uniform permutation of all samples per epoch (every sample equally likely at
every position).

``BlockOrder`` (``--shuffle block``, prepared shards only): per epoch the shards are permuted, cut into
windows of ``window`` consecutive shards (the last window may hold fewer), and the samples of each
window permuted together; the epoch's order is the windows' orders one after another. A run then
reads one window of shards at a time (``window`` shards in the page cache per node suffice), and the
samples of a window are contiguous in the order, so a global batch (consecutive samples of the order)
no larger than a window holds samples of at most two windows. The related designs: MosaicML streaming's
``py1e`` shuffle (shards permuted, samples shuffled within overlapping blocks of shards) and FFCV's
``OrderOption.QUASI_RANDOM`` (samples permuted within pages held in memory); docs/data.md, Shuffle order, says
what the order gives up in randomness and how to choose ``window``.

Both orders depend on (seed, epoch) and the data only, never on the layout or the loader processes,
so every layout sees the same global batches and a resumed run continues the same order mid-epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from rayconv.config import Config
from rayconv.errors import ConfigError


@dataclass(frozen=True)
class ExactOrder:
    """All ``size`` samples permuted per epoch (numpy's PCG64 seeded by [seed, epoch, 0x5EED])."""

    size: int
    seed: int

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices of the epoch in order, shape (size,), int64, a permutation of range(size)."""
        return np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(self.size)


@dataclass(frozen=True)
class BlockOrder:
    """Shards permuted per epoch, then the samples of each window of ``window`` shards permuted.

    ``rows``: the samples of each shard in the split's order (sample k is row k of the shards taken in
    order, as ``rayconv.prepare`` writes them); ``window`` >= 1 shards per window."""

    rows: tuple[int, ...]
    window: int
    seed: int

    @property
    def size(self) -> int:
        return int(sum(self.rows))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices of the epoch in order, shape (size,), int64, a permutation of range(size)."""
        rng, windows = self._windows(epoch)
        starts = np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)])
        parts = []
        for shards in windows:
            members = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in shards])
            parts.append(members[rng.permutation(len(members))])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def windows(self, epoch: int) -> list[np.ndarray]:
        """The shard indices of each window of the epoch, in order (what ``epoch_order`` permutes)."""
        return self._windows(epoch)[1]

    def _windows(self, epoch: int) -> tuple[np.random.Generator, list[np.ndarray]]:
        rng = np.random.default_rng([self.seed, epoch, 0xB10C])
        shards = rng.permutation(len(self.rows))
        return rng, [shards[w:w + self.window] for w in range(0, len(shards), self.window)]


def make_order(cfg: Config, source: Any) -> Optional[BlockOrder]:
    """The order ``cfg.shuffle`` names for ``source``'s train split: None for exact (``Sharding``'s
    default), a BlockOrder over the train shards of a prepared folder (``source.manifest``) for block.
    Raises ConfigError when block is asked of data without shards."""
    if cfg.shuffle != "block":
        return None
    manifest = getattr(source, "manifest", None)
    if not isinstance(manifest, dict):
        raise ConfigError(
            f"--shuffle block permutes within windows of shards: --data {cfg.data} has no shards; "
            "use --data shards, or --shuffle exact")
    rows = tuple(int(e["rows"]) for e in manifest["splits"]["train"]["shards"])
    if sum(rows) != source.train_size:
        raise ConfigError(f"--shuffle block: the manifest's train shards hold {sum(rows)} rows, the data "
                          f"{source.train_size} samples: prepare the folder again")
    return BlockOrder(rows, cfg.shuffle_window, cfg.seed)

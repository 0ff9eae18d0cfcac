"""One gather call for a batch of raw-pixel rows spread over many memory-mapped shards.

The pixel pieces of a split's raw shards (``OpenShard.pieces``: (rows, width) uint8 views into the
shards' mappings) lie at various addresses of the process. ``RowGather`` sees the address range from
the lowest piece's first byte to the highest piece's last as one uint8 tensor, and that tensor as
overlapping rows of ``width`` bytes, one starting at every byte (strides (1, 1): nothing is copied or
touched), so that the rows of a batch, in any shards, are gathered by ONE ``torch.index_select`` of
their byte offsets: one call that releases the GIL for the whole copy, whatever the number of shards a
batch touches, where one numpy call per shard would take and release it once per shard. Only bytes of
the pieces are read (the offsets are those of rows in them): the range between the mappings is never
touched. The mappings live as long as the shards (``OpenShard.mmap``), which a ``RowGather`` holds.
The reader process (``raw_reader``) reads the same view through numpy (``copy_np``: fancy indexing of
the overlapping rows, no torch in that process); torch is imported by ``copy`` alone.
"""

from __future__ import annotations

import ctypes

import numpy as np


class RowGather:
    """The rows of ``shards`` (a split's ``OpenShard`` list, raw) numbered 0.. in shard order.

    ``locate(idx)`` then ``copy(at, out)``: rows ``idx`` (int array) copied into ``out`` in ``idx``'s
    order; ``locate`` raises IndexError for a row outside 0..rows - 1."""

    def __init__(self, shards: list):
        firsts, addresses, ends, shard_of, bases = [], [], [], [], []
        first, self.width = 0, 0
        for s, sh in enumerate(shards):
            for row0, data, _ in sh.pieces:
                if len(data):
                    firsts.append(first + row0)
                    addresses.append(data.ctypes.data)
                    ends.append(data.ctypes.data + data.nbytes)
                    shard_of.append(s)
                    bases.append(sh.base)
                    self.width = data.shape[1]
            first += sh.rows
        self.rows, self.shards = first, shards   # (the shards' mappings stay while this reads them)
        self.firsts = np.asarray(firsts, np.int64)
        self.shard_of = np.asarray(shard_of, np.int64)
        if not firsts:
            self.low, self.view, self.np_view = 0, None, None
            return
        self.low = min(addresses)
        self.offsets = np.asarray(addresses, np.int64) - self.low   # byte offset of each piece's first row
        self.file_offsets = np.asarray(addresses, np.int64) - np.asarray(bases, np.int64)   # ... in its file
        self.span = max(ends) - self.low
        self.view = None   # (the torch view, made by the first ``copy``)
        self.np_view = np.lib.stride_tricks.as_strided(
            np.frombuffer((ctypes.c_ubyte * self.span).from_address(self.low), dtype=np.uint8),
            shape=(self.span - self.width + 1, self.width), strides=(1, 1), writeable=False)

    def _pieces(self, idx: np.ndarray) -> np.ndarray:
        if len(idx) and (idx.min() < 0 or idx.max() >= self.rows):
            bad = idx[(idx < 0) | (idx >= self.rows)][0]
            raise IndexError(f"sample {bad} is outside the split's {self.rows} rows")
        return np.searchsorted(self.firsts, idx, side="right") - 1

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte offsets of rows ``idx`` in the range, int64 (len(idx),); the shard numbers they lie in,
        distinct, sorted): what ``copy`` reads, and which shards to check before."""
        at, shard = self.rows_at(idx)
        return at, np.flatnonzero(np.bincount(shard, minlength=len(self.shards)))   # (no sort)

    def rows_at(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte offsets of rows ``idx`` in the range, the shard number of each), int64 (len(idx),):
        ``locate`` for many batches at once (a whole announcement)."""
        idx = np.asarray(idx, dtype=np.int64)
        p = self._pieces(idx)
        return self.offsets[p] + (idx - self.firsts[p]) * self.width, self.shard_of[p]

    def file_ranges(self, idx: np.ndarray) -> list[tuple[int, list[tuple[int, int]]]]:
        """Per shard that rows ``idx`` touch, in shard order: (shard number, the (file offset, length) of
        those rows' bytes, sorted, ranges closer than 4 KiB merged), for read-ahead; no per-row Python."""
        idx = np.asarray(idx, dtype=np.int64)
        p = self._pieces(idx)
        shard, start = self.shard_of[p], self.file_offsets[p] + (idx - self.firsts[p]) * self.width
        order = np.lexsort((start, shard))
        shard, start = shard[order], start[order]
        # (rows of one width, sorted: a range starts at a new shard or more than 4 KiB past the row before)
        firsts = np.flatnonzero(
            np.r_[True, (shard[1:] != shard[:-1]) | (start[1:] > start[:-1] + self.width + 4096)]
        )
        lasts = np.r_[firsts[1:], len(start)] - 1
        shard, offs, lengths = shard[firsts], start[firsts], start[lasts] + self.width - start[firsts]
        cuts = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]]).tolist() + [len(shard)]
        return [(int(shard[a]), list(zip(offs[a:b].tolist(), lengths[a:b].tolist())))
                for a, b in zip(cuts, cuts[1:])]

    def copy(self, at: np.ndarray, out):
        """The rows at byte offsets ``at`` (from ``locate``) copied into ``out`` (a uint8 torch tensor
        (len(at), width), contiguous), in order: one ``torch.index_select``. Returns ``out``."""
        import torch

        if not len(at):
            return out
        if self.view is None:
            whole = torch.frombuffer((ctypes.c_ubyte * self.span).from_address(self.low), dtype=torch.uint8)
            self.view = whole.as_strided((self.span - self.width + 1, self.width), (1, 1))
        return torch.index_select(self.view, 0, torch.from_numpy(at), out=out)

    def copy_np(self, at: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``copy`` into a numpy array ``out`` (uint8 (len(at), width)): one fancy index of the rows."""
        if len(at):
            out[...] = self.np_view[at]
        return out

"""Training data: what each actor reads, decided by (seed, epoch, step, dp rank) alone.

Modules: ``source`` (the Source interface, TensorSource, Sharding: the epoch order and each replica's
slice, stable_seed, test_shard), ``registry`` (``--data`` name -> Source, loader workers), ``digits``,
``fashion_mnist``, ``on_device`` (small uint8 image sets held on the actor's device), ``augment``
(batched crop, flip, normalise and resize of NCHW uint8 tensors), ``synthetic``, ``folders`` (what an
image folder holds and what is skipped), ``imagefolder`` (torchvision ImageFolder + DataLoader),
``shards`` (reading prepared Parquet shards), ``shard_writer`` (writing them: ``python -m
rayconv.prepare``), ``decode`` (JPEG decode, crop, flip, normalise for shards).
"""

from rayconv.data.registry import make_source
from rayconv.data.source import Sharding, Source

__all__ = ["Source", "Sharding", "make_source"]

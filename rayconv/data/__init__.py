"""Training data: what each actor reads, decided by (seed, epoch, step, dp rank) alone.

Modules: ``source`` (the Source interface, TensorSource, Sharding: the epoch order and each replica's
slice, stable_seed, test_shard), ``registry`` (``--data`` name -> Source, loader workers), ``digits``,
``fashion_mnist``, ``on_device`` (small uint8 image sets held on the actor's device), ``augment``
(batched crop, flip, normalise and resize of NCHW uint8 tensors), ``synthetic``, ``folders`` (what an
image folder holds and what is skipped), ``imagefolder`` (torchvision ImageFolder + DataLoader),
``shards`` (reading prepared Parquet shards), ``shard_writer`` (writing them: ``python -m
rayconv.prepare``), ``decode`` (JPEG decode, crop, flip, normalise for shards), ``raw_shards`` and
``raw_reader`` (raw-pixel shards, gathered in a reader process).

The package imports nothing itself (``make_source``, ``Source`` and ``Sharding`` are looked up on first
use), so that a torch-free module of it (``shard_files``, ``raw_reader``'s process) imports without torch.
"""

__all__ = ["Source", "Sharding", "make_source"]


def __getattr__(name: str):
    if name == "make_source":
        from rayconv.data.registry import make_source
        return make_source
    if name in ("Source", "Sharding"):
        from rayconv.data import source
        return getattr(source, name)
    raise AttributeError(f"module 'rayconv.data' has no attribute {name!r}")

"""Training data: what each actor reads, decided by (seed, epoch, step, dp rank) alone.

Modules: ``source`` (the Source interface, TensorSource, Sharding: each replica's share of every
step, stable_seed, replica_test_indices), ``order`` (the epoch order: ``--shuffle exact|block``),
``registry`` (``--data`` name -> Source, loader workers), ``digits``, ``fashion_mnist``, ``synthetic``,
``folders`` (what an image folder holds and what is skipped),
``imagefolder`` (torchvision ImageFolder + DataLoader), ``small`` (image
and shard folders decoded once for ``--data-on-device``), ``on_device`` (uint8 image sets held on the actor's
device, batches made there), ``augment`` (batched crop, flip, normalise and resize of NCHW uint8 tensors),
``augment_graph`` (that augmentation replayed as one CUDA graph), ``auto_augment`` (``--auto-augment``
policies, batched), ``shard_files`` (the prepared folder's format: a manifest and Arrow IPC shards, read
memory-mapped), ``shards`` (reading JPEG shards), ``decode`` (JPEG decode, crop, flip, normalise for shards),
``raw_shards``, ``raw_reader`` and ``raw_gather`` (raw-pixel shards, gathered in a reader process),
``shard_table`` (one shard and the manifest, written atomically), ``shard_writer`` (``python -m
rayconv.prepare``), ``shard_convert`` (the older Parquet format rewritten as Arrow IPC).

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

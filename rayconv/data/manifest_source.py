"""A prepared folder in object storage as the driver's checks see it (``registry.check_source``): its
sizes, classes and image shape read from the bucket's manifest alone, no shard fetched.

The driver (the head node, often without GPUs and with a small disk) only checks the run: it needs the
class count, the sample counts, the images' shape, the manifest (``--shuffle block``'s order) and
whether the actors hold the data on the device (``--data-on-device auto``). The shards are fetched only
by the nodes whose actors read them (``cache.ShardCache``, from ``registry.make_source``).
``--cache-bytes``, where given and without ``--stage-dir``, is checked here: a set larger than it streams
(``shard_stream``) and is refused before Ray starts only where the shards one replica's batch of epoch 0
reads do not fit it (``shard_remote.min_window``); the default budget depends on each node's own disk
and is checked where the set is read.
"""

from __future__ import annotations

import numpy as np

from rayconv.config import Config
from rayconv.data import auto_augment as aa
from rayconv.data.cache import ShardCache
from rayconv.data.folders import SPLITS
from rayconv.data.on_device import augment_words, pad_for
from rayconv.data.raw_shards import augmentation_words as raw_words
from rayconv.data.shard_files import encoding
from rayconv.data.shard_remote import min_window
from rayconv.data.shards import augmentation_words as jpeg_words
from rayconv.data.small import held_on_device, held_words
from rayconv.data.source import Source
from rayconv.errors import DataError


class ManifestSource(Source):
    """``cfg.data_dir`` (a URI in object storage) described from its manifest: ``num_classes``,
    ``sample_shape`` (3, S, S), ``train_size``, ``test_size``, ``manifest``, ``augmentation`` (the words
    of the source the actors open) and ``held`` (whether the actors hold it on the device:
    ``small.held_on_device``). ``images`` and ``labels`` raise DataError: nothing is read here. Raises
    StorageError / DataError as ``cache.remote_manifest``, and DataError for a set that cannot stream
    through a given ``--cache-bytes`` or a split without images."""

    def __init__(self, cfg: Config):
        shards = ShardCache(cfg.data_dir or "", cfg.cache_dir, cfg.cache_bytes)   # (the manifest only)
        self.uri, self.manifest, self.name = shards.uri, shards.manifest, "shards"
        self.classes = list(self.manifest["classes"])
        self.num_classes = len(self.classes)
        size = cfg.data_image_size
        self.sample_shape = (3, size, size)
        rows = {s: sum(int(e["rows"]) for e in self.manifest["splits"][f]["shards"])
                                for s, f in SPLITS.items()}
        self.train_size, self.test_size = rows["train"], rows["test"]
        if self.train_size == 0 or self.test_size == 0:
            raise DataError(f"{self.uri} holds {self.train_size} train and {self.test_size} val images: "
                            "both splits need images")
        # (--stage-dir: read from there, no cache)
        if cfg.cache_bytes is not None and not cfg.stage_dir and shards.set_bytes > cfg.cache_bytes:
            shards.check_streams(cfg.cache_bytes, min_window(cfg, self))
        if cfg.auto_augment:
            aa.make_transform(cfg.auto_augment)   # (raises ConfigError for an unknown policy, as the actors')
        augment, erase, auto = cfg.augmentation, cfg.random_erase, cfg.auto_augment
        raw = encoding(self.manifest) == "raw"
        self.held = held_on_device(cfg, self.train_size + self.test_size)
        if self.held:   # (HeldSource's words: OnDeviceSource's, then what is held)
            pad, flip = (pad_for(size), True) if augment == "pad-crop" else (0, augment == "resized-crop")
            self.augmentation = augment_words(augment, pad, flip, erase, auto) + held_words(
                raw, (self.train_size + self.test_size) * 3 * size * size)
        elif raw:
            self.augmentation = raw_words(augment, size, erase, auto, int(self.manifest["image_shape"][0]))
        else:
            self.augmentation = jpeg_words(augment, size, erase, auto, cfg.decode)

    def images(self, split: str, idx: np.ndarray, device, epoch: int = 0, dtype=None):
        raise DataError(f"{self.uri}: the driver reads no shard of a set in object storage (the actors do)")

    def labels(self, split: str, idx: np.ndarray):
        raise DataError(f"{self.uri}: the driver reads no shard of a set in object storage (the actors do)")

    def add_val_split(self) -> None:
        """Split "val" is the train split's (nothing to open here)."""

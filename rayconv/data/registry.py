"""``--data NAME`` -> the Source that reads it, and how many decode processes an actor's loader gets.

Names: ``digits`` (``rayconv/data/digits.py``; 8x8, not augmented, whatever ``--image-size`` and
``--augment`` say), ``fashion-mnist`` (``fashion_mnist.py``; resized on the device to ``--image-size``),
``synthetic`` (``synthetic.py``), ``imagefolder`` (``imagefolder.py``; a folder prepared by ``python -m
rayconv.prepare`` is read as shards) and ``shards`` (``shards.py``; raw-pixel shards ``raw_shards.py``).
``--augment`` (resolved by ``Config.augmentation``), ``--auto-augment`` and ``--random-erase`` reach
fashion-mnist, imagefolder and shards; ``--channels`` (``model_channels``) every source. Small image folders
and shard folders are held on the device (``--data-on-device``, ``rayconv/data/small.py``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np
import torch

from rayconv.config import Config, ConfigError
from rayconv.data.cache import local_folder
from rayconv.data.digits import load_digits
from rayconv.data.order import BlockOrder, ExactOrder
from rayconv.data.fashion_mnist import HeaderSource, load_fashion_mnist
from rayconv.data.fashion_mnist import read_ahead as read_fashion_mnist_ahead
from rayconv.data.imagefolder import ImageFolderSource
from rayconv.data.manifest_source import ManifestSource
from rayconv.data.raw_shards import RawShardSource
from rayconv.data.shard_files import encoding, folder_encoding
from rayconv.data.shard_stream import open_stream
from rayconv.data.shards import ShardSource, is_prepared
from rayconv.data.small import maybe_hold
from rayconv.data.source import Source
from rayconv.models.channels import user_model_channels
from rayconv.settings import DataSettings
from rayconv.user_model import is_user_model, takes_in_channels
from rayconv.data.synthetic import SyntheticSource
from rayconv.storage import is_remote, is_uri

GREY_MODELS = ("convnet", "convnet_bn", "convnet2col")  # rayconv.models' models that take any channel count


def model_channels(cfg: Config, src: Source) -> int:
    """The channels the model gets: ``--channels``, else the data's own for colour data, rayconv's small
    ConvNets and a user's FUNCTION that takes ``in_channels``; for grey data given to a user's FUNCTION
    not told its channels, the count its model takes (``user_model_channels``: 1 or 3); else 3 for grey
    data (a model made for RGB: torchvision's, alexnet2012)."""
    own = src.sample_shape[0]
    if cfg.channels is not None:
        return cfg.channels
    if own != 1 or cfg.model in GREY_MODELS:
        return own
    if is_user_model(cfg.model):
        if takes_in_channels(cfg.model):
            return own
        return user_model_channels(cfg.model, src.num_classes, tuple(src.sample_shape[1:]))
    return 3


def loader_workers(cfg: Config) -> int:
    """Decode processes per actor: ``--loader-workers``, or by default on GPUs this node's CPU cores per
    GPU less 2 (one for the actor, one spare), at least 2; on CPUs 2 (the actors use the cores)."""
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, cores // max(1, torch.cuda.device_count()) - 2)


def decode_workers(cfg: Config) -> int:
    """Processes of the one-time decode of data held on the device (``small.py``): ``--loader-workers``,
    or by default on GPUs this node's CPU cores per GPU (nothing else runs while it decodes: all the
    node's cores among its actors), at least 2; on CPUs 2 (the actors use the cores)."""
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, cores // max(1, torch.cuda.device_count()))


def read_ahead(cfg: DataSettings) -> None:
    """Read now what ``make_source(cfg)`` reads whole from files before it returns (fashion-mnist's four
    idx files and their statistics), so that a later ``make_source`` of the same files in this process
    finds them read: an actor calls it on a thread of its own while it imports and the driver checks.
    Other sources read their files lazily: nothing to do. A failure is left for ``make_source`` to report."""
    if cfg.data == "fashion-mnist":
        read_fashion_mnist_ahead(cfg.data_dir)


def first_epoch_order(cfg: Config, manifest: dict) -> np.ndarray:
    """Epoch 0's train sample order of the prepared folder ``manifest`` describes, as the run takes it
    (``data.order``; the validation split's images left in: it orders the shards' fetch only)."""
    rows = tuple(int(e["rows"]) for e in manifest["splits"]["train"]["shards"])
    block = cfg.shuffle == "block"
    order = BlockOrder(rows, cfg.shuffle_window, cfg.seed) if block else ExactOrder(sum(rows), cfg.seed)
    return order.epoch_order(0)


def make_source(cfg: Config, num_classes: Optional[int] = None) -> Source:
    """The data source named by ``cfg.data``, giving the model ``model_channels``. Raises DataError /
    ConfigError."""
    augment, erase = cfg.augmentation, cfg.random_erase
    if cfg.data == "digits":
        src: Source = load_digits()
    elif cfg.data == "fashion-mnist":
        src = load_fashion_mnist(cfg.data_dir, cfg.seed, cfg.image_size, augment, erase, cfg.auto_augment)
    elif cfg.data == "synthetic":
        src = SyntheticSource(cfg.data_image_size, cfg.num_classes or 1000, cfg.synthetic_samples, cfg.seed)
    elif cfg.data in ("imagefolder", "shards"):
        stream = None   # a bucket's set larger than --cache-bytes: streamed (data/shard_stream.py)
        if cfg.data_dir and is_remote(cfg.data_dir):
            stream = open_stream(cfg)
        if stream is None and cfg.data_dir and is_uri(cfg.data_dir):   # a bucket: this node's cache
            cfg = dataclasses.replace(cfg, data_dir=local_folder(cfg, lambda m: first_epoch_order(cfg, m)))
        raw = stream is not None and encoding(stream.manifest) == "raw"
        if raw or (stream is None and (cfg.data == "shards" or is_prepared(cfg.data_dir))
                   and folder_encoding(cfg.data_dir) == "raw"):
            src = RawShardSource(cfg.data_dir or "", cfg.data_image_size, cfg.seed, augment=augment,
                                 random_erase=erase, auto_augment=cfg.auto_augment,
                                 stream=stream)   # raw pixels: no decode
        elif stream is not None or cfg.data == "shards" or is_prepared(cfg.data_dir):   # read as shards
            src = ShardSource(cfg.data_dir or "", cfg.data_image_size, cfg.seed, loader_workers(cfg),
                              cfg.decode, augment=augment, random_erase=erase, auto_augment=cfg.auto_augment,
                              stream=stream)
        else:
            src = ImageFolderSource(cfg.data_dir or "", cfg.data_image_size, cfg.seed, loader_workers(cfg),
                                    augment=augment, random_erase=erase, auto_augment=cfg.auto_augment)
        # --data-on-device: small data held on the device (a streamed set read in this process: its
        # fetcher thread is not in forked workers)
        src = maybe_hold(cfg, src, decode_workers(cfg) if stream is None else 0)
    else:
        raise ConfigError(f"unknown --data {cfg.data!r}")
    return checked(cfg, src)


def check_source(cfg: Config) -> Source:
    """The source the driver's checks read: ``make_source``'s, except that a prepared folder in object
    storage is described from its manifest alone (``ManifestSource``: no shard fetched; the nodes whose
    actors read the set fetch it) and Fashion-MNIST from its idx headers (``fashion_mnist.HeaderSource``:
    no image file decompressed; the actors read the files). Raises DataError / ConfigError /
    StorageError."""
    if cfg.data in ("imagefolder", "shards") and cfg.data_dir and is_remote(cfg.data_dir):
        return checked(cfg, ManifestSource(cfg))
    if cfg.data == "fashion-mnist":
        return checked(cfg, HeaderSource(cfg.data_dir, cfg.seed, cfg.image_size, cfg.augmentation,
                                         cfg.random_erase, cfg.auto_augment))
    return make_source(cfg)


def checked(cfg: Config, src: Source) -> Source:
    """``src`` checked against ``--num-classes``, given the model's channels and the ``--val-split``
    split. Raises ConfigError."""
    if cfg.num_classes is not None and cfg.num_classes != src.num_classes:
        raise ConfigError(f"--num-classes {cfg.num_classes} but --data {cfg.data} has {src.num_classes} "
                          "classes: drop --num-classes (it follows the data)")
    src.set_channels(model_channels(cfg, src))
    if cfg.val_split > 0:
        src.add_val_split()   # split "val": --val-split's images, read unaugmented
    return src

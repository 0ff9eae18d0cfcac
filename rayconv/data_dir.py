"""``--data-dir DIR`` without ``--data``: the data kind the folder holds.

A folder written by ``python -m rayconv.prepare`` (its ``manifest.json``) is ``shards``; one with
``train/`` and ``val/`` folders is ``imagefolder``; one with Fashion-MNIST's train images idx file
(plain or gzipped) is ``fashion-mnist``. Anything else is refused in one line naming the --data to give.
Plain Python (the file names are written out, ``tests/unit/test_flags.py`` checks them against the
readers'), so that the command lines stay free of torch until their arguments are known to be good.

A ``--data-dir`` URI (``s3://bucket/prefix``, ``gs://...``: ``rayconv.storage``) holds prepared shards
(read through each node's cache: ``rayconv.data.cache``); its manifest is read here, before Ray, so a
missing bucket, an unreachable endpoint or a prefix without a manifest is one line. A ``file://`` URI
is the local folder it names.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

from rayconv.errors import ConfigError

MANIFEST = "manifest.json"                           # rayconv.data.shard_files.MANIFEST
FASHION_MNIST_TRAIN = "train-images-idx3-ubyte"      # rayconv.data.fashion_mnist.FILES["train"][0]
FOLDER_KINDS = ("imagefolder", "shards", "fashion-mnist")   # the --data kinds that read --data-dir


def raw_side(data_dir: Optional[str]) -> Optional[int]:
    """The stored side in pixels of a raw-pixel shard folder (its manifest's ``image_shape``), None for
    JPEG shards, no folder or a manifest that does not read (the shard checks name what is wrong)."""
    if data_dir and is_uri(data_dir):
        try:
            return _raw_side_of(remote_manifest(data_dir))
        except ConfigError:
            return None
    path = Path(data_dir) / MANIFEST if data_dir else None
    try:
        return _raw_side(str(path), path.stat().st_mtime_ns) if path else None
    except OSError:
        return None


@lru_cache(maxsize=16)
def _raw_side(path: str, mtime_ns: int) -> Optional[int]:
    try:
        return _raw_side_of(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


def _raw_side_of(manifest: dict) -> Optional[int]:
    try:
        return int(manifest["image_shape"][0]) if manifest.get("encoding") == "raw" else None
    except (KeyError, TypeError, IndexError, ValueError, AttributeError):
        return None


def is_uri(where: str) -> bool:
    """Whether ``where`` names a file system by scheme (``rayconv.storage.is_uri``)."""
    from rayconv.storage import is_uri as uri
    return uri(where)


@lru_cache(maxsize=16)
def remote_manifest(uri: str) -> dict:
    """The manifest of the prepared folder at ``uri`` (one read per process and URI; a ``file://`` URI's
    folder is read as a local one). Raises ConfigError (rayconv.data.cache.remote_manifest: a missing
    bucket, an unreachable endpoint, no manifest), as one line."""
    from rayconv.data.cache import remote_manifest as read
    from rayconv.errors import DataError
    try:
        return read(uri)[2]
    except DataError as e:
        raise ConfigError(str(e)) from None


def data_of_folder(data_dir: str) -> str:
    """The ``--data`` kind of ``data_dir``: shards, imagefolder or fashion-mnist (module docstring).
    Raises ConfigError for a folder that does not exist or holds none of them."""
    if is_uri(data_dir):
        from rayconv.storage import is_remote, locate
        if not is_remote(data_dir):
            return data_of_folder(str(locate(data_dir, flag="--data-dir").local))
        remote_manifest(data_dir)
        return "shards"
    root = Path(data_dir)
    if not root.is_dir():
        raise ConfigError(f"--data-dir {data_dir}: no such folder (give an image folder with train/ and "
                          "val/, a folder written by python -m rayconv.prepare, or one holding the "
                          "Fashion-MNIST idx files)")
    if (root / MANIFEST).is_file():
        return "shards"
    if (root / "train").is_dir() and (root / "val").is_dir():
        return "imagefolder"
    if any((root / name).is_file() for name in (FASHION_MNIST_TRAIN, FASHION_MNIST_TRAIN + ".gz")):
        return "fashion-mnist"
    raise ConfigError(f"--data-dir {data_dir} holds neither train/ and val/ folders (--data imagefolder), a "
                      f"{MANIFEST} of python -m rayconv.prepare (--data shards) nor the Fashion-MNIST idx "
                      "files (--data fashion-mnist): give --data for what it holds, or fix the folder")


def with_data_kind(values: dict) -> dict:
    """Settings ``values`` (flag names without dashes) with ``data`` taken from ``data_dir`` when only
    the folder is given. Raises ConfigError (``data_of_folder``), and for a ``data_dir`` beside a
    ``data`` that reads no folder (digits, synthetic: the folder would be ignored)."""
    data_dir = values.get("data_dir")
    if not data_dir:
        return values
    if "data" not in values:
        values = {**values, "data": data_of_folder(data_dir)}
        if is_uri(data_dir):
            check_cache_bytes(data_dir, values.get("cache_bytes"), values.get("stage_dir"))
        return values
    if is_uri(data_dir) and values["data"] in FOLDER_KINDS:
        kind = data_of_folder(data_dir)   # (a bucket, its manifest, the endpoint: checked before Ray)
        if values["data"] != "imagefolder" and kind != values["data"]:
            raise ConfigError(f"--data-dir {data_dir} holds {kind} data: give --data {kind} (or drop --data)")
        check_cache_bytes(data_dir, values.get("cache_bytes"), values.get("stage_dir"))
    if values["data"] not in FOLDER_KINDS:
        raise ConfigError(f"--data-dir {data_dir} is read by --data {', '.join(FOLDER_KINDS)}, not --data "
                          f"{values['data']}: drop --data-dir, or --data (then the folder's kind is used)")
    return values


def check_cache_bytes(uri: str, budget, stage_dir=None) -> None:
    """Refuse, before Ray, a set in object storage that cannot stream through a given ``--cache-bytes``
    (a shard larger than it: ``rayconv.data.shard_stream``; the batch's window is checked by the
    driver's ``ManifestSource``). Raises ConfigError (one line saying what to
    change); a budget not given, or not a positive int (refused by the settings' checks), is left, as is
    a set copied to ``--stage-dir`` (read from there, not through the cache)."""
    from rayconv.storage import is_remote
    bad = not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0
    if bad or stage_dir or not is_remote(uri):
        return
    from rayconv.data.cache import ShardCache
    from rayconv.errors import DataError
    try:
        ShardCache(uri, budget=budget).check_streams(budget)
    except DataError as e:
        raise ConfigError(str(e)) from None

"""``python -m rayconv.prepare DIR --out SHARDS``: the command line that re-encodes an ImageNet-layout
folder into Arrow IPC shards of training-size JPEGs for ``--data shards`` (``rayconv/data/shard_writer.py``
does the work and says how), one Ray task per shard on the cluster (``--address``, RAY_ADDRESS or a
running cluster, else a local one). ``--encoding raw`` stores raw pixels instead (uint8 size x size x 3,
read without a decode; ``auto``: raw up to 64 px, ``shard_writer.resolve_encoding`` says why).
``python -m rayconv.prepare --convert DIR`` rewrites a folder of the older Parquet format in place;
``--convert DIR --encoding raw|jpeg --out NEW`` re-encodes a prepared folder into NEW
(``rayconv/data/shard_convert.py``).

Exit status: 0 done; 2 bad arguments or bad input (the message names the file or folder, an --out that
cannot be written among them); 1 the
cluster failed, or the disk filled during --convert (no half shard is left); 130 interrupted
(complete shards are kept: the same command again finishes the job).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from rayconv.flags import OneLineParser
from rayconv.data.shard_convert import convert, convert_encoding
from rayconv.data.shard_writer import (ENCODINGS, RAW_MAX_SIZE, SHARD_ORDERS, prepare, resolve_encoding,
                                       write_shard)
from rayconv.errors import ClusterError, ConfigError, DataError
from rayconv.storage import is_remote, locate
from rayconv.storage_checks import check_writable


def _on_ray(args: dict[str, tuple], address: Optional[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each shard's ``write_shard`` as a Ray task; yields (name, entry) as they finish. Raises DataError
    naming the shard whose task failed (the others are cancelled)."""
    import ray   # (Ray's import takes seconds: not for --help or a bad argument)

    from rayconv.cluster import connect as cluster  # (imports Ray, as above)
    from rayconv.cluster.acquire import release_kept

    cluster.connect(address)
    release_kept()   # (actors a run of this process kept would hold CPUs the tasks need)
    print(f"prepare: Ray: {cluster.cluster_origin()}")
    task = ray.remote(num_cpus=1)(write_shard)
    refs = {task.remote(*a): name for name, a in args.items()}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            yield refs[ready[0]], ray.get(ready[0])
        except ray.exceptions.RayTaskError as e:   # e.g. the disk is full: the shard stays unwritten
            for ref in pending:
                ray.cancel(ref)
            cause = e.cause if e.cause is not None else e
            raise DataError(f"writing {args[refs[ready[0]]][1]}/{refs[ready[0]]} failed "
                            f"({type(cause).__name__}: {cause}): fix that and run the same command again "
                            "(complete shards are kept)") from None


RAW_SHARD_MIB = 64   # --shard-size's default for raw pixels: images of that many MiB a shard


def default_shard_size(encoding: str, size: int) -> int:
    """--shard-size left out: 1000 JPEGs; raw pixels: ``RAW_SHARD_MIB`` MiB of size x size x 3 images (at
    least 1000), since a batch's gather costs one step per shard it touches, not per image."""
    return max(1000, (RAW_SHARD_MIB << 20) // (size * size * 3)) if encoding == "raw" else 1000


def _parser() -> OneLineParser:
    p = OneLineParser(prog="python -m rayconv.prepare", error_name="rayconv.prepare",
                      description="Re-encode an ImageNet-layout folder (train/<class>/*, val/<class>/*) into "
                                  "Arrow IPC shards of training-size JPEGs for --data shards, on the Ray "
                                  "cluster.")
    p.add_argument("dir", nargs="?", help="the image folder, holding train/ and val/")
    p.add_argument("--out", help="the folder to write the shards and manifest.json into (required with DIR)")
    p.add_argument("--convert", metavar="SHARDS", default=None,
                   help="rewrite a prepared folder of the older Parquet format in place, then exit; with "
                        "--encoding and --out: re-encode a prepared folder (raw <-> jpeg) into the --out "
                        "folder")
    p.add_argument("--encoding", choices=ENCODINGS, default=None,
                   help="how images are stored: jpeg (default; re-encoded at --quality, shorter side "
                        "--size), raw (uint8 pixels, --size x --size: shorter side resized to --size, then "
                        f"the center crop; no decode when read) or auto (raw up to --size {RAW_MAX_SIZE}, "
                        "jpeg above)")
    p.add_argument("--size", type=int, default=256,
                   help="shorter side in pixels (default 256; never enlarged)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality 1-100 (default 90)")
    p.add_argument("--shard-size", type=int, default=None,
                   help=f"images per shard (default: 1000 JPEGs; raw pixels: as many as make {RAW_SHARD_MIB} "
                        "MiB, at least 1000, so that a random batch touches few shards)")
    p.add_argument("--shard-order", choices=SHARD_ORDERS, default="shuffled",
                   help="order of the train files in the shards: shuffled (default; a permutation seeded by "
                        "--seed, so that each shard mixes the classes) or sorted (the listing's order, one "
                        "class after another); val is always sorted")
    p.add_argument("--seed", type=int, default=0, help="seed of --shard-order shuffled (default 0)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, a running "
                                                   "cluster, else a new local one)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    a = _parser().parse_args(argv)
    if (a.convert is None) == (a.dir is None) or (a.dir is not None and a.out is None):
        print("rayconv.prepare: error: give DIR --out SHARDS, or --convert SHARDS alone", file=sys.stderr)
        return 2
    if a.convert is not None and (a.encoding is None) != (a.out is None) \
            or a.encoding == "auto" and a.dir is None:
        print("rayconv.prepare: error: --convert SHARDS alone rewrites the Parquet format; re-encoding takes "
              "--convert SHARDS --encoding raw|jpeg --out NEW", file=sys.stderr)
        return 2
    if a.shard_size is None:
        a.shard_size = default_shard_size(resolve_encoding(a.encoding or "jpeg", a.size), a.size)
    for flag, v, lo, hi in (("--size", a.size, 32, 1 << 16), ("--quality", a.quality, 1, 100),
                            ("--shard-size", a.shard_size, 1, 1 << 24)):
        if not lo <= v <= hi:
            print(f"rayconv.prepare: error: {flag} must be in [{lo}, {hi}] (got {v})", file=sys.stderr)
            return 2
    try:
        for flag, folder in (("--out", a.out), ("--convert", a.convert)):
            if folder is not None:   # (a read-only folder, /proc, a missing bucket: one line before Ray)
                check_writable(folder, flag)
        if a.convert is not None and a.encoding is not None:
            convert_encoding(a.convert, a.out, a.encoding, a.quality)
            return 0
        if a.convert is not None:
            convert(a.convert)
            return 0
        remote = is_remote(a.out)   # a bucket: prepared in a local folder, uploaded with its manifest last
        if remote:
            from rayconv.data.cache import staging_folder, upload_prepared
            locate(a.out, flag="--out")   # (a URI with a secret, or one that cannot be opened: refused first)
        out = str(staging_folder(a.out)) if remote else a.out
        prepare(a.dir, out, a.size, a.quality, a.shard_size, fan_out=lambda args: _on_ray(args, a.address),
                shard_order=a.shard_order, seed=a.seed, encoding=a.encoding or "jpeg")
        if remote:
            upload_prepared(Path(out), a.out)
        return 0
    except (DataError, ConfigError) as e:   # (ConfigError: StorageError, a --out URI)
        print(f"rayconv.prepare: error: {e}", file=sys.stderr)
        return 2
    except (ClusterError, OSError) as e:   # OSError: --convert on a full disk (no half shard is left)
        print(f"rayconv.prepare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rayconv.prepare: interrupted: complete shards are kept in {a.out or a.convert}; run the same "
              "command again to finish", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

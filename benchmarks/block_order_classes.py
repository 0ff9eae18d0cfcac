"""Distinct classes per global batch under --shuffle block against the exact order, on labels laid
out in shards as ``rayconv.prepare --shard-order`` writes them: ``shuffled`` (its default: the train
files in its seeded permutation, ``shard_listing``, so a shard mixes the classes) or ``sorted`` (the
sorted listing: class c's samples consecutive, one shard holds one or two classes).

    python benchmarks/block_order_classes.py [--classes 1000 --per-class 1281 --shard-size 1000 --batch 256]
                                             [--shard-order shuffled|sorted --windows 1,8,64]

Labels only (no images; file names stand in for the paths): shards of --shard-size rows in order;
prints, for each window W, the mean number of distinct classes in the first 300 global batches of epoch
0 (``rayconv.data.order``) and its ratio to the exact order's."""

from __future__ import annotations

import argparse

import numpy as np

from rayconv.data.order import BlockOrder, ExactOrder
from rayconv.data.shard_writer import SHARD_ORDERS, shard_listing


def distinct(order, labels: np.ndarray, batch: int, batches: int = 300) -> float:
    o = order.epoch_order(0)
    n = min(batches, len(o) // batch)
    return float(np.mean([len(np.unique(labels[o[i * batch:(i + 1) * batch]])) for i in range(n)]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--windows", default="8,64,128,256,512,768")
    p.add_argument("--shard-order", choices=SHARD_ORDERS, default="shuffled")
    p.add_argument("--seed", type=int, default=0, help="prepare's --seed")
    a = p.parse_args()
    n = a.classes * a.per_class
    listing = [(f"train/c{c:05d}/{i:07d}.JPEG", c) for c in range(a.classes) for i in range(a.per_class)]
    labels = np.asarray([label for _, _, label in shard_listing(listing, a.shard_order, a.seed)])
    rows = tuple([a.shard_size] * (n // a.shard_size) + ([n % a.shard_size] if n % a.shard_size else []))
    exact = distinct(ExactOrder(n, 0), labels, a.batch)
    print(f"{a.classes} classes x {a.per_class}, {len(rows)} {a.shard_order} shards of {a.shard_size}, "
          f"global batch {a.batch}: "
          f"exact order {exact:.1f} distinct classes per batch")
    for w in (int(x) for x in a.windows.split(",")):
        got = distinct(BlockOrder(rows, w, 0), labels, a.batch)
        print(
            f"  --shuffle-window {w:5d} ({w / len(rows):5.1%} of the shards): {got:6.1f} ({got / exact:.2f}x)"
        )


if __name__ == "__main__":
    main()

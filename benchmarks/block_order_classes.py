"""Distinct classes per global batch under --shuffle block against the exact order, on class-sorted
labels as ``rayconv.prepare`` writes them (sorted listing: one shard holds one or two classes).

    python benchmarks/block_order_classes.py [--classes 1000 --per-class 1281 --shard-size 1000 --batch 256]

Labels only (no images): class c's samples are consecutive, shards of --shard-size rows in order;
prints, for each window W, the mean number of distinct classes in the first 300 global batches of epoch
0 (``rayconv.data.order``) and its ratio to the exact order's."""

from __future__ import annotations

import argparse

import numpy as np

from rayconv.data.order import BlockOrder, ExactOrder


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
    a = p.parse_args()
    n = a.classes * a.per_class
    labels = np.repeat(np.arange(a.classes), a.per_class)
    rows = tuple([a.shard_size] * (n // a.shard_size) + ([n % a.shard_size] if n % a.shard_size else []))
    exact = distinct(ExactOrder(n, 0), labels, a.batch)
    print(f"{a.classes} classes x {a.per_class}, {len(rows)} shards of {a.shard_size}, global batch {a.batch}: "
          f"exact order {exact:.1f} distinct classes per batch")
    for w in (int(x) for x in a.windows.split(",")):
        got = distinct(BlockOrder(rows, w, 0), labels, a.batch)
        print(f"  --shuffle-window {w:5d} ({w / len(rows):5.1%} of the shards): {got:6.1f} ({got / exact:.2f}x)")


if __name__ == "__main__":
    main()

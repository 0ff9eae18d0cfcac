"""The host side of streaming raw-pixel shards, per batch, as an actor's step thread sees it.

    python benchmarks/raw_host.py RAW_DIR [--device cpu|cuda] [--batch 512] [--steps 300] [--image-size 32]
                                          [--reader-alone [--busy]]

RAW_DIR: a folder of ``python -m rayconv.prepare --encoding raw``. The step thread's sequence is the
actor's (``actor/batches.py``): the epoch announced at its first step (``prefetch``), then per step
``images`` of the step's batch, then a stand-in for the rest of the step's host work (``--ops`` small
tensor operations on the device, each of which releases and takes back the GIL, as the step's do).
Prints per batch: the hand-off (``_take``: the wait for the reader process's reply), ``images`` in all (on
CPU it includes the augmentation, which a GPU runs on the device), the stand-in's time with the reader
running against its time alone, and how many steps found their batch read ahead. ``--reader-alone``:
the reader's throughput with nothing else running: the steps' batches announced, then taken one after
another (``_take``, no device copy, augmentation or stand-in), batches/s and images/s of the whole,
after one untimed pass over the train split (the reader process started and the pages mapped in it:
the steady state of epochs after the first); with ``--busy``, taken by a thread that runs small tensor
operations while the next batch is not ready (a step thread that never idles: each operation releases and
takes back the GIL), whose operations/s it prints too (beside a reader process they run as they do alone).
``--threads``: torch's intra-op threads (an actor's ``--num-cpus-per-actor``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from rayconv.data.raw_shards import RawShardSource
from rayconv.data.source import Sharding



def _timed(fn, seconds: list[float]):
    """``fn`` wrapped to append each call's wall seconds to ``seconds``."""
    def timed(*a):
        t = time.perf_counter()
        out = fn(*a)
        seconds.append(time.perf_counter() - t)
        return out
    return timed

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--ops", type=int, default=300, help="small device operations per step (the stand-in)")
    p.add_argument("--reader-alone", action="store_true", help="time the reader alone (see above)")
    p.add_argument("--busy", action="store_true", help="--reader-alone, taken by a busy thread (see above)")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    src = RawShardSource(args.dir, args.image_size, seed=0, augment="pad-crop")
    sh = Sharding(src.train_size, args.batch, 0)
    spe = sh.steps_per_epoch
    if args.reader_alone:
        batches = [sh.replica_batch(e, k, 0, 1)[0] for e in range(2) for k in range(spe)][:args.steps]
        # (the reader process started and the pages mapped in it, one pass, before the clock starts)
        chunks = np.array_split(np.arange(src.train_size), max(1, src.train_size // args.batch))
        src.prefetch("train", 0, chunks)
        for chunk in chunks:
            src._take("train", chunk, dev)
        w, n_ops = torch.zeros(16), 0
        t = time.perf_counter()
        src.prefetch("train", 0, batches)
        for b in batches:
            ahead = src._pending["train"][0][1]
            while args.busy and ahead not in src._reader.arrived and not src._reader.replies.poll(0):
                w.add_(1.0)
                n_ops += 1
            src._take("train", b, dev)
        dt = time.perf_counter() - t
        where = f"taken by a busy thread ({n_ops / dt:.0f} operations/s there)" if args.busy else "alone"
        print(f"reader process {where}: {len(batches)} batches of {args.batch} in "
              f"{dt:.3f} s: {len(batches) / dt:.0f} batches/s, {len(batches) * args.batch / dt:.0f} images/s")
        return
    w = torch.zeros(16, device=dev)

    def stand_in() -> float:
        t = time.perf_counter()
        for _ in range(args.ops):
            w.add_(1.0)
        return time.perf_counter() - t
    alone = np.median([stand_in() for _ in range(50)])
    take_ms, images_ms, work, hits = [], [], [], 0
    last: list[float] = []
    src._take = _timed(src._take, last)
    for step in range(args.steps):
        epoch, s = divmod(step, spe)
        if s == 0:
            src.prefetch("train", epoch, [sh.replica_batch(epoch, k, 0, 1)[0] for k in range(spe)])
        idx = sh.replica_batch(epoch, s, 0, 1)[0]
        q = src._pending.get("train")
        hits += bool(q) and np.array_equal(q[0][0], idx)
        t = time.perf_counter()
        src.images("train", idx, dev, epoch, dtype=torch.bfloat16)
        images_ms.append((time.perf_counter() - t) * 1e3)
        take_ms.append(last[-1] * 1e3)
        work.append(stand_in())
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    med = lambda v: f"{np.median(v):.3f} ms (mean {np.mean(v):.3f})"  # noqa: E731
    print(f"{args.steps} steps of {args.batch} on {dev}, {spe} steps an epoch; batch read ahead at {hits} of "
          f"{args.steps} steps")
    print(f"hand-off (_take) per batch: {med(take_ms)}")
    print(f"images() per batch: {med(images_ms)}")
    slow = np.argsort(images_ms)[::-1][:5]
    print("slowest images() calls (step, step in epoch, ms): " + ", ".join(
        f"({k}, {k % spe}, {images_ms[k]:.1f})" for k in slow))
    print(
        f"stand-in ({args.ops} ops) alone {alone * 1e3:.3f} ms, beside the reader {med(np.array(work) * 1e3)}"
    )


if __name__ == "__main__":
    main()

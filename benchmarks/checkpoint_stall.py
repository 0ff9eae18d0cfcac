"""Training time lost per checkpoint: the synchronous checkpoint through the driver against the actors'
own background writes (to a local folder and to an S3-compatible bucket on loopback), in one process.

    python benchmarks/checkpoint_stall.py [--steps 60] [--every 10] [--batch 32] [--window 6] [--json OUT]

Each mode is one run of resnet18 on synthetic 32 px images, dp2 on CPU (float32), ``--checkpoint-every
10``, evaluation only at the end: ``sync`` (``RAYCONV_SYNC_CHECKPOINTS=1``: every actor's whole state
through the driver, written before training continues, to a local folder), ``async-local`` and
``async-s3`` (moto's server on loopback in a process of its own, as a bucket's server is not in the
driver, started before Ray so that the actors inherit its endpoint).
From metrics.parquet, each train step's driver clock (``time_s``): the interval between consecutive
steps' results; the median interval away from checkpoints is the step; the time lost at a checkpoint is
the sum over the ``--window`` intervals after it of (interval - median step) (a background write shows
in the steps after the checkpoint, a synchronous one in the first). Also the time the step loop was
blocked in the checkpoint call itself (``blocked``: the copy to host memory and the call's round trip
for the background writes; everything for the synchronous one). The run's last checkpoint (at its
last step, no steps after) is left out. Prints per mode the median time lost per checkpoint, the ratio
to ``sync``'s, the bytes of rank files per checkpoint against one replica's state, and the bytes the
driver received per checkpoint (``sync``: the rank files; the actors' writes: their files' names, sizes
and sha256, as the manifest lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def run_mode(mode: str, out: str, args) -> dict:
    from rayconv.config import Config
    from rayconv.driver.job import train_run
    from rayconv.driver.saving import SYNC_ENV
    from rayconv.outputs.checkpoint import list_checkpoints, load_checkpoint

    if mode == "sync":
        os.environ[SYNC_ENV] = "1"
    else:
        os.environ.pop(SYNC_ENV, None)
    cfg = Config(model="resnet18", data="synthetic", image_size=32, num_classes=10, dp=2,
                 global_batch_size=args.batch, steps=args.steps, precision="fp32", device="cpu",
                 progress=False,
                 eval_every=10 ** 6, out=out, checkpoint_every=args.every, keep_checkpoints=0,
                 loader_workers=0, synthetic_samples=args.batch * args.steps).validate()
    import rayconv.driver.loop as loop
    blocked, inner = [], loop.checkpoint

    def timed(*a, **k):   # (the step loop blocked by the checkpoint call itself)
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            blocked.append(time.perf_counter() - t)

    loop.checkpoint = timed
    t0 = time.perf_counter()
    try:
        train_run(cfg, log=lambda *_: None)
    finally:
        loop.checkpoint = inner
    wall = time.perf_counter() - t0
    rows = [r for r in _read_metrics(out).to_pylist() if r["kind"] == "train"]
    t = {r["step"]: r["time_s"] for r in rows}
    steps = sorted(t)
    d = {k: t[k] - t[k - 1] for k in steps[1:]}
    ck_after = [k for k in steps if (k + 1) % args.every == 0 and k + 1 < args.steps]   # (the last left out)
    near = {k + j for k in ck_after for j in range(1, args.window + 1)}
    base = statistics.median(v for k, v in d.items() if k not in near and k > 2)
    lost = [sum(d[k + j] - base for j in range(1, args.window + 1) if k + j in d) for k in ck_after]
    ckpts = list_checkpoints(out)
    c = load_checkpoint(ckpts[0])
    parts = sum(f["bytes"] for f in c.manifest["files"] if f["name"].startswith("rank-"))
    one = len(c.rank_file(0))
    through = parts if mode == "sync" else len(json.dumps([f for f in c.manifest["files"]
                                                           if f["name"].startswith("rank-")]))
    return {"mode": mode, "wall_s": round(wall, 2), "median_step_s": round(base, 4),
            "lost_per_checkpoint_s": [round(x, 3) for x in lost],
            "median_lost_s": round(statistics.median(lost), 3),
            "blocked_s": [round(x, 3) for x in blocked],
            "median_blocked_s": round(statistics.median(blocked[:-1]), 3),
            "rank_file_bytes": parts, "one_replica_bytes": one, "bytes_ratio": round(parts / one, 4),
            "driver_bytes_per_checkpoint": through, "checkpoints": [str(p) for p in ckpts],
            "format": c.manifest["format"]}


def _read_metrics(out: str):
    import io

    import pyarrow.parquet as pq

    from rayconv.storage import locate
    return pq.read_table(io.BytesIO(locate(out.rstrip("/") + "/metrics.parquet").read_bytes()))


@contextlib.contextmanager
def moto_process():
    """moto's S3 server in a child process on a free loopback port, a bucket made, the client
    environment set in this process (and so in the Ray cluster started after it)."""
    from support.ray_head import free_port
    from support.s3_server import S3Server
    s3 = S3Server(free_port(), "rayconv-bench")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3.port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                s3.filesystem().create_dir(s3.bucket)
                break
            except OSError:
                time.sleep(0.2)
        os.environ.update(s3.env)
        yield s3
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--window", type=int, default=6)
    p.add_argument("--modes", default="sync,async-local,async-s3")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from conftest import local_ray   # (a local Ray cluster as the tests start it)

    results = []
    with tempfile.TemporaryDirectory(prefix="ckstall-") as tmp, moto_process() as s3:
        for _ in local_ray(4):
            for mode in args.modes.split(","):
                out = s3.uri("stall", mode) if mode == "async-s3" else f"{tmp}/{mode}"
                r = run_mode(mode, out, args)
                results.append(r)
                print(json.dumps(r), flush=True)
    sync = next((r for r in results if r["mode"] == "sync"), None)
    print(f"\n{'mode':12} {'step s':>8} {'lost/ckpt s':>12} {'vs sync':>8} {'blocked s':>10} {'vs sync':>8} "
          f"{'bytes/replica':>14} {'driver bytes':>13}")
    for r in results:
        ok = sync is not None and sync["median_lost_s"] > 0
        ratio = r["median_lost_s"] / sync["median_lost_s"] if ok else float("nan")
        held = r["median_blocked_s"] / sync["median_blocked_s"] if sync else float("nan")
        print(f"{r['mode']:12} {r['median_step_s']:8.3f} {r['median_lost_s']:12.3f} {ratio:8.3f} "
              f"{r['median_blocked_s']:10.3f} {held:8.3f} "
              f"{r['bytes_ratio']:14.3f} {r['driver_bytes_per_checkpoint']:13,}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

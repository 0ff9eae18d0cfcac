"""Runs in one Python process on kept actors (``--keep-actors-s``): the same short run RUNS + 1 times in
turn, each one's wall time from ``rayconv.fit``'s call to its summary and its step 0 since the call
(summary.json ``startup.phases.first_step``). Run 0 (``--keep-actors-s 0``) pays the driver's own first
imports and is not counted; run 1 starts new actors (the anchor); the rest reuse run 1's.

    python benchmarks/kept_actors.py [--runs 3] [--dp 2] [--steps 16] [--device cpu]

A local Ray cluster of its own (``ray.init`` with ``--num-cpus``, no dashboard) is started here and
shut down at the end. Prints one line per run and a last line: the mean of the reused runs over the
first (the anchor: the same run on new actors, in the same process).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs counted (the first starts the actors; one uncounted run before)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    p.add_argument("--steps", type=int, default=16, help="steps per run")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local cluster")
    a = p.parse_args(argv)
    import ray

    import rayconv

    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=True,
             logging_level="WARNING")
    walls = []
    try:
        with tempfile.TemporaryDirectory(prefix="kept-actors-") as tmp:
            for i in range(a.runs + 1):
                t0 = time.perf_counter()
                s = rayconv.fit(model="convnet", data="digits", dp=a.dp, steps=a.steps, eval_every=a.steps,
                                device=a.device, progress=False, tensorboard="off", out=str(Path(tmp) / f"run{i}"),
                                keep_actors_s=0 if i == 0 else 60,
                                log=lambda *_: None)
                walls.append(time.perf_counter() - t0)
                print(f"run {i}: {walls[-1]:.2f} s, step 0 {s['startup']['phases']['first_step']:.2f} s after the call, "
                      f"{'kept actors' if i > 1 else 'new actors'}, test accuracy {s['test_accuracy']:.4f}", flush=True)
    finally:
        rayconv.release_actors()
        ray.shutdown()
    if len(walls) > 2:
        reused = sum(walls[2:]) / len(walls[2:])
        print(f"RESULT kept actors: {reused:.2f} s a run against {walls[1]:.2f} s on new ones ({reused / walls[1]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

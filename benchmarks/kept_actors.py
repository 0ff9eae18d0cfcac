"""Runs in one Python process on kept actors (``--keep-actors-s``): the same short run RUNS + 1 times in
turn, each one's wall time from ``rayconv.fit``'s call to its summary and its step 0 since the call
(summary.json ``startup.phases.first_step``). Run 0 (``--keep-actors-s 0``) pays the driver's own first
imports and is not counted; run 1 starts new actors (the anchor); the rest reuse run 1's.

    python benchmarks/kept_actors.py [--runs 3] [--dp 2] [--steps 16] [--device cpu]
    python benchmarks/kept_actors.py --cycle 1,2 [--runs 6]   # layouts of 1 and 2 actors in turn

With ``--cycle``, the runs go through those data-parallel sizes in turn, RUNS runs twice: first each
with ``--keep-actors-s 0`` (the anchor: every run starts its actors), then with the actors kept (the
groups of each size side by side where the cluster has room); the last line gives the second's total
wall time over the first's.

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
    p.add_argument("--runs", type=int, default=3,
                   help="runs counted (the first starts the actors; one uncounted run before)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    p.add_argument("--steps", type=int, default=16, help="steps per run")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local cluster")
    p.add_argument("--cycle", default="", help="data-parallel sizes the runs go through in turn, e.g. 1,2")
    a = p.parse_args(argv)
    if a.cycle:
        return cycle(a, [int(x) for x in a.cycle.split(",")])
    import ray

    import rayconv

    _start_ray(a)
    walls = []
    try:
        with tempfile.TemporaryDirectory(prefix="kept-actors-") as tmp:
            for i in range(a.runs + 1):
                t0 = time.perf_counter()
                s = _fit(a, Path(tmp) / f"run{i}", a.dp, a.steps, keep_s=0 if i == 0 else 60)
                walls.append(time.perf_counter() - t0)
                print(
                    f"run {i}: {walls[-1]:.2f} s, step 0 {s['startup']['phases']['first_step']:.2f} s after"
                    f" the call, {'kept actors' if i > 1 else 'new actors'}, test accuracy"
                    f" {s['test_accuracy']:.4f}",
                    flush=True,
                )
    finally:
        rayconv.release_actors()
        ray.shutdown()
    if len(walls) > 2:
        reused = sum(walls[2:]) / len(walls[2:])
        print(
            f"RESULT kept actors: {reused:.2f} s a run against {walls[1]:.2f} s on new ones"
            f" ({reused / walls[1]:.2f}x)"
        )
    return 0


def _start_ray(a) -> None:
    """A local Ray cluster of ``a.num_cpus`` CPUs, no dashboard, for this process."""
    import ray

    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=True,
             logging_level="WARNING")


def _fit(a, out: Path, dp: int, steps: int, keep_s: float) -> dict:
    """One quiet run of the digits ConvNet on ``a.device`` into ``out``; its summary."""
    import rayconv

    return rayconv.fit(
        model="convnet",
        data="digits",
        dp=dp,
        steps=steps,
        eval_every=steps,
        device=a.device,
        progress=False,
        tensorboard="off",
        out=str(out),
        keep_actors_s=keep_s,
        log=lambda *_: None,
    )


def cycle(a, sizes: list[int]) -> int:
    """The runs through ``sizes`` in turn, with and without kept actors (see the module's docstring)."""
    import ray

    import rayconv

    _start_ray(a)
    totals = {}
    try:
        with tempfile.TemporaryDirectory(prefix="kept-actors-") as tmp:
            _fit(a, Path(tmp) / "first", 1, 2, keep_s=0)   # (the driver's own first imports, not counted)
            for keep_s in (0, 60):
                t0 = time.perf_counter()
                for i in range(a.runs):
                    dp = sizes[i % len(sizes)]
                    s = _fit(a, Path(tmp) / f"k{keep_s}-{i}", dp, a.steps, keep_s)
                    renewed = "renewed" in s["startup"].get("actor_process", {})
                    print(
                        f"keep {keep_s} run {i} dp {dp}: step 0 {s['startup']['phases']['first_step']:.2f} s"
                        f" after the call, {'kept actors' if renewed else 'new actors'}",
                        flush=True,
                    )
                totals[keep_s] = time.perf_counter() - t0
                rayconv.release_actors()
    finally:
        rayconv.release_actors()
        ray.shutdown()
    print(
        f"RESULT cycle {a.cycle}, {a.runs} runs: {totals[60]:.2f} s with kept actors against {totals[0]:.2f}"
        f" s starting new ones ({totals[60] / totals[0]:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

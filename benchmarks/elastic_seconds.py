"""Seconds lost per layout change of an --elastic run, on CPU, against the target bound (issue 33):
at most the work since the last checkpoint plus one actor start-up.

    python benchmarks/elastic_seconds.py [--steps 20] [--checkpoint-every 4] [--out DIR]

Two Ray nodes on this machine (``ray.cluster_utils.Cluster``, 2 CPUs each, their own ports and temp
folders, shut down at the end), ``--dp 4 --elastic 2`` (two actors a node), convnet on the digits in
float64. Four changes, one of each kind: the second node removed mid-interval (a loss: the steps
since the last checkpoint are redone, after --elastic-wait for devices that do not come back), an
actor's SIGTERM (a preemption: a checkpoint at the step boundary), the node added back (a grow at the
next checkpoint), an actor's SIGKILL (a loss whose devices come back at once). For each change: the
seconds lost (summary.json's ``layout_changes``, from the loss detected to the next step done), the
work redone (steps redone x the median step time), one actor start-up (the run's own, from Ray
connected to its first step done, as a change is counted to its next step done), the --elastic-wait spent
where the lost devices did not come back, and their sum, the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rayconv.config import Config  # noqa: E402
from rayconv.driver.job import train_run  # noqa: E402

WAIT_S = 1.0   # --elastic-wait


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--out", default=None, help="run folder (default: a new temporary folder)")
    args = ap.parse_args(argv)
    every = args.checkpoint_every
    # after which step each event happens: mid-interval, so the loss redoes steps
    at = {"remove": every + every // 2, "sigterm": 2 * every + 1, "add": 3 * every - 1, "kill": 4 * every + 1}
    if args.steps <= at["kill"] + 1:
        ap.error(f"--steps must be above {at['kill'] + 1} for --checkpoint-every {every}")
    out = Path(args.out or tempfile.mkdtemp(prefix="elastic-seconds-")) / "run"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                             "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=2, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rayconv", log_to_driver=False, logging_level="WARNING")
        done: dict[str, object] = {}

        def events(actor_group, step):
            if step == at["remove"] and "remove" not in done:
                done["remove"] = cluster.remove_node(worker)
            elif step == at["sigterm"] and "sigterm" not in done:
                done["sigterm"] = os.kill(actor_group.info[1]["pid"], signal.SIGTERM)
            elif step == at["add"] and "add" not in done:
                done["add"] = cluster.add_node(num_cpus=2, resources={"node_b": 1})
                cluster.wait_for_nodes()
                deadline = time.monotonic() + 30   # (until its CPUs show as free: the grow check reads them)
                while ray.available_resources().get("node_b", 0) < 1 and time.monotonic() < deadline:
                    time.sleep(0.2)
            elif step == at["kill"] and "kill" not in done:
                done["kill"] = os.kill(actor_group.info[0]["pid"], signal.SIGKILL)

        cfg = Config(model="convnet", data="digits", dp=4, global_batch_size=64, steps=args.steps, lr=0.05,
                     precision="fp64", device="cpu", progress=False, eval_every=args.steps, out=str(out),
                     checkpoint_every=every, elastic=2, elastic_wait=WAIT_S, max_failures=2,
                     collective_timeout_s=30, loader_workers=0).validate()
        t0 = time.monotonic()
        summary = train_run(
            cfg, log=lambda line: print(f"[{time.monotonic() - t0:6.1f} s] {line}"), on_step=events
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    rows = [r for r in pq.read_table(out / "metrics.parquet").to_pylist() if r["kind"] == "train"]
    step_s = statistics.median(r["step_ms"] for r in rows if r.get("step_ms")) / 1000
    phases = summary["startup"]["phases"]
    startup_s = phases["first_step"] - phases["ray"]
    print(
        f"\nmedian step {step_s:.3f} s; one actor start-up {startup_s:.2f} s (Ray connected -> first step"
        f" done); --elastic-wait {WAIT_S:g} s"
    )
    print(f"{'step':>4}  {'change':<12} {'why':<34} {'lost s':>7} {'redone':>6} {'bound s':>7}  within")
    within = True
    for c in summary["layout_changes"]:
        shrunk = int(c["to"][2:]) < int(c["from"][2:]) and "lost" in c["why"]
        bound = c["steps_redone"] * step_s + startup_s + (WAIT_S if shrunk else 0.0)
        within &= c["seconds_lost"] <= bound
        print(
            f"{c['step']:>4}  {c['from'] + '->' + c['to']:<12} {c['why'][:34]:<34} {c['seconds_lost']:>7.2f} "
            f"{c['steps_redone']:>6} {bound:>7.2f}  {'yes' if c['seconds_lost'] <= bound else 'no'}")
    print(json.dumps({"step_s": round(step_s, 4), "actor_startup_s": round(startup_s, 3),
                      "elastic_wait_s": WAIT_S, "layout_changes": summary["layout_changes"],
                      "all_within_bound": within}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

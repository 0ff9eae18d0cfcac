"""Training time lost per checkpoint: the synchronous checkpoint through the driver against the actors'
own background writes (to a local folder and to an S3-compatible bucket on loopback), in one process.

    python benchmarks/checkpoint_stall.py [--steps 60] [--checkpoint-every 10] [--rounds 1] [--out DIR]

The CPU form (the defaults): resnet18 on synthetic 32 px images, 10 classes, dp2 on CPU (fp32), global
batch 32, 60 steps, ``--checkpoint-every 10``. The GPU form (one GPU, the S3 server started separately
or by the script):

    python benchmarks/checkpoint_stall.py --device cuda --dp 1 --model resnet50 --image-size 224 \\
        --num-classes 1000 --global-batch-size 256 --precision bf16 --steps 300 --checkpoint-every 50 \\
        --modes sync,async-s3 [--s3-endpoint http://127.0.0.1:PORT] --out DIR

Modes, each one run of the same configuration, evaluation only at the end: ``sync``
(``RAYCONV_SYNC_CHECKPOINTS=1``: every actor's whole state through the driver, written before training
continues, to a local folder: the anchor), ``async-local`` and ``async-s3`` (the actors' background
writes to a local folder, to a bucket). The bucket's server: ``--s3-endpoint`` (a running S3-compatible
server, e.g. ``python -m moto.server -H 127.0.0.1 -p PORT``; its bucket made here; keys from
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, else moto's test keys), else moto's server started here
on a free loopback port in a process of its own, put at the lowest CPU priority (nice 19) once it
answers (it stands for remote storage, whose CPU is not the training machine's), before Ray so that the
actors inherit its endpoint. moto is needed (and looked for) only when ``async-s3`` runs without
``--s3-endpoint``.
``--rounds N`` runs the modes N times, interleaved (sync, async-local, async-s3, sync, ...), each round's
ratios against that round's ``sync``.

From metrics.parquet, each train step's driver clock (``time_s``): the interval between consecutive
steps' results; the median interval away from checkpoints (and after ``--warmup`` steps) is the step; the
time lost at a checkpoint is the sum over the boundary step's interval and the ``--window`` intervals
after it (default: 0.6 of ``--checkpoint-every``) of (interval - median step): the wall-clock from the
last result before the boundary to the window's end against as many median steps (a background write
shows in the steps after the checkpoint, a synchronous one in the first). The boundary's own interval
counts because a step's result returns with the next step's call: on a CPU the call computes its step
first, so at a boundary where the actors go quiet (``sync``'s) the flush returns right after the step
before (an interval near 0) and the first step after the checkpoint reports only once the second has run
(one step more); the background writes' checkpoints are queued behind their step, no flush. Also the time
the step loop was blocked in the checkpoint call itself (``blocked``: queueing the calls for the
background writes; everything for the synchronous one). The run's last checkpoint (at its last step, no
steps after) is left out. Per mode and round: the median time lost per checkpoint and its ratio to
``sync``'s, the same for ``blocked``, the bytes of rank files per checkpoint against one replica's state,
and the bytes the driver received per checkpoint (``sync``: the rank files; the actors' writes: their
files' names, sizes and sha256, as the manifest lists them). Where moto's server runs here (``async-s3``
without ``--s3-endpoint``), the CPU seconds that server spent per checkpoint (``/proc``: its user and
system time over the run, by the checkpoints written), beside the CPU seconds the machine has between two
checkpoints (its cores times ``--checkpoint-every`` median steps): on a machine whose cores the training
fills, the server's own work is taken from the training, whatever the writers do.

Output: one JSON row per run on stdout as it ends, then one line per mode (the medians over rounds, the
rounds' range in brackets); with ``--out DIR``, ``DIR/rows.json`` (every row, with the configuration and
the load average before and after each run, and every step's interval: ``interval_s``, by step).
Bad flags: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
MODES = ("sync", "async-local", "async-s3")
BUCKET = "rayconv-bench"
SERVER: dict[str, Optional[int]] = {"pid": None}   # moto's server process, where started here


def run_mode(mode: str, out: str, args) -> dict:
    from rayconv.config import Config
    from rayconv.driver.job import train_run
    from rayconv.driver.saving import SYNC_ENV
    from rayconv.outputs.checkpoint import list_checkpoints, load_checkpoint

    if mode == "sync":
        os.environ[SYNC_ENV] = "1"
    else:
        os.environ.pop(SYNC_ENV, None)
    cfg = Config(model=args.model, data="synthetic", image_size=args.image_size, num_classes=args.num_classes,
                 dp=args.dp, global_batch_size=args.global_batch_size, steps=args.steps,
                 precision=args.precision, device=args.device, progress=False,
                 eval_every=10 ** 6, out=out, checkpoint_every=args.checkpoint_every, keep_checkpoints=0,
                 loader_workers=0, synthetic_samples=args.global_batch_size * args.steps).validate()
    import rayconv.driver.loop as loop
    blocked, inner = [], loop.checkpoint

    def timed(*a, **k):   # (the step loop blocked by the checkpoint call itself)
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            blocked.append(time.perf_counter() - t)

    loop.checkpoint = timed
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        train_run(cfg, log=lambda *_: None)
    finally:
        loop.checkpoint = inner
    wall = time.perf_counter() - t0
    every, window = args.checkpoint_every, args.window
    rows = [r for r in _read_metrics(out).to_pylist() if r["kind"] == "train"]
    t = {r["step"]: r["time_s"] for r in rows}
    steps = sorted(t)
    d = {k: t[k] - t[k - 1] for k in steps[1:]}
    ck_after = [k for k in steps if (k + 1) % every == 0 and k + 1 < args.steps]   # (the last left out)
    near = {k + j for k in ck_after for j in range(0, window + 1)}   # (the boundary's interval too)
    base = statistics.median(v for k, v in d.items() if k not in near and k > args.warmup)
    lost = [sum(d[k + j] - base for j in range(0, window + 1) if k + j in d) for k in ck_after]
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
            "format": c.manifest["format"], "interval_s": {k: round(v, 4) for k, v in d.items()},
            "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_metrics(out: str):
    import io

    import pyarrow.parquet as pq

    from rayconv.storage import locate
    return pq.read_table(io.BytesIO(locate(out.rstrip("/") + "/metrics.parquet").read_bytes()))


def _client_env(endpoint: str) -> dict[str, str]:
    """What this process and the Ray cluster started after it need to reach the server at ``endpoint``
    (keys already in the environment are kept; moto takes any)."""
    return {"AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
            "AWS_REGION": os.environ.get("AWS_REGION", "us-east-1"),
            "AWS_EC2_METADATA_DISABLED": "true"}


def _make_bucket(endpoint: str, bucket: str, wait_s: float) -> None:
    """Make ``bucket`` at ``endpoint`` (already there: fine), trying for ``wait_s`` seconds while the
    server starts. Raises OSError when it cannot be reached."""
    import pyarrow.fs as pafs
    ep = urllib.parse.urlsplit(endpoint)
    env = _client_env(endpoint)
    fs = pafs.S3FileSystem(endpoint_override=ep.netloc, scheme=ep.scheme or "http",
                           access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"],
                           region=env["AWS_REGION"], allow_bucket_creation=True)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fs.create_dir(bucket)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def bucket_server(endpoint: Optional[str], bucket: str) -> Iterator[str]:
    """The S3 endpoint to write to, its bucket made and the client environment set in this process (and
    so in the Ray cluster started after it): ``endpoint`` as given, else moto's server in a child process
    on a free loopback port, at nice 19 once it answers (ended on exit)."""
    proc = None
    if endpoint is None:   # (the process is kept in SERVER, for its CPU seconds)
        from support.ray_head import free_port
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _make_bucket(endpoint, bucket, 60.0 if proc is not None else 2.0)
        if proc is not None:   # (once up: the threads it starts for requests inherit its main thread's)
            os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
        os.environ.update(_client_env(endpoint))
        SERVER["pid"] = proc.pid if proc is not None else None
        yield endpoint
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


def _bad(message: str) -> None:
    print(f"checkpoint_stall: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="fp32")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--window", type=int, default=None,
                   help="intervals after a checkpoint counted as its cost "
                        "(default: 0.6 of --checkpoint-every)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median step")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-cpus", type=int, default=4, help="the local Ray cluster's logical CPUs")
    p.add_argument("--s3-endpoint", default=None,
                   help="a running S3-compatible server (http://host:port); default: moto started here")
    p.add_argument("--bucket", default=BUCKET)
    p.add_argument("--out", default=None, help="a folder for rows.json")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        _bad(f"--modes: {','.join(bad) or 'none'} unknown; choose from {','.join(MODES)}")
    args.modes = modes
    if args.window is None:
        args.window = max(1, math.ceil(0.6 * args.checkpoint_every))
    if args.checkpoint_every < 2 or args.window >= args.checkpoint_every:
        _bad(f"--window ({args.window}) must be below --checkpoint-every ({args.checkpoint_every}), "
                "which must be >= 2, so that steps away from checkpoints give the median step")
    if args.steps < 2 * args.checkpoint_every:
        _bad(f"--steps ({args.steps}) must be >= 2 x --checkpoint-every ({args.checkpoint_every}): "
                "the last checkpoint has no steps after it, so it is left out")
    if args.rounds < 1:
        _bad(f"--rounds must be >= 1 (got {args.rounds})")
    if "async-s3" in modes and args.s3_endpoint is None and importlib.util.find_spec("moto") is None:
        _bad("async-s3 needs an S3 server: moto is not installed here (pip install 'moto[server]'); "
                "or give --s3-endpoint of a running one")
    scheme = urllib.parse.urlsplit(args.s3_endpoint or "http://").scheme
    if scheme not in ("http", "https"):
        _bad(f"--s3-endpoint {args.s3_endpoint}: give http://host:port or https://host:port")
    return args


def summary(results: list[dict]) -> list[str]:
    """One line per mode: the medians over rounds of the step, the time lost and blocked per checkpoint
    (and their ratios to the same round's sync), with the rounds' range."""
    sync = {r["round"]: r for r in results if r["mode"] == "sync"}

    def spread(xs: list[float], unit: str, digits: int = 3) -> str:
        m = statistics.median(xs)
        rng = f" [{min(xs):.{digits}f}-{max(xs):.{digits}f}]" if len(xs) > 1 else ""
        return f"{m:.{digits}f}{unit}{rng}"

    lines = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]
        text = (f"{mode}: step {spread([r['median_step_s'] for r in rs], ' s')}, "
                f"lost per checkpoint {spread([r['median_lost_s'] for r in rs], ' s')}")
        paired = [(r, sync[r["round"]]) for r in rs if r["round"] in sync]
        if paired and mode != "sync":
            lost = [r["median_lost_s"] / s["median_lost_s"] for r, s in paired if s["median_lost_s"] > 0]
            held = [r["median_blocked_s"] / s["median_blocked_s"] for r, s in paired
                    if s["median_blocked_s"] > 0]
            text += f" ({spread(lost, 'x')} of sync's)" if lost else " (sync lost nothing)"
            text += f", blocked {spread([r['median_blocked_s'] for r in rs], ' s')}"
            text += f" ({spread(held, 'x')} of sync's)" if held else ""
        else:
            text += f", blocked {spread([r['median_blocked_s'] for r in rs], ' s')}"
        if "server_cpu_s_per_checkpoint" in rs[0]:
            text += (f", the server's CPU {spread([r['server_cpu_s_per_checkpoint'] for r in rs], ' s')} "
                     "per checkpoint (the machine's between two: "
                     f"{spread([r['machine_cpu_s_between_checkpoints'] for r in rs], ' s')})")
        text += (f", bytes {spread([r['bytes_ratio'] for r in rs], 'x', 4)} one replica's state, "
                 f"driver {statistics.median(r['driver_bytes_per_checkpoint'] for r in rs):,.0f} B "
                 "per checkpoint, "
                 f"{len(rs)} round(s)")
        lines.append(text)
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    from conftest import local_ray   # (a local Ray cluster as the tests start it)

    results = []
    config = {k: v for k, v in vars(args).items() if k not in ("out",)}
    s3 = "async-s3" in args.modes
    with tempfile.TemporaryDirectory(prefix="ckstall-") as tmp, \
            (bucket_server(args.s3_endpoint, args.bucket) if s3 else contextlib.nullcontext()):
        for _ in local_ray(args.num_cpus):
            for i in range(args.rounds):
                for mode in args.modes:
                    out = (f"s3://{args.bucket}/stall/{i}/{mode}" if mode == "async-s3"
                           else f"{tmp}/{i}/{mode}")
                    pid = SERVER["pid"] if mode == "async-s3" else None
                    cpu0 = cpu_seconds(pid) if pid else 0.0
                    r = {"round": i, **run_mode(mode, out, args)}
                    if pid:
                        r["server_cpu_s_per_checkpoint"] = round((cpu_seconds(pid) - cpu0)
                                                                 / len(r["checkpoints"]), 3)
                        r["machine_cpu_s_between_checkpoints"] = round(
                            os.cpu_count() * args.checkpoint_every * r["median_step_s"], 3)
                    results.append(r)
                    print(json.dumps(r), flush=True)
    print()
    for line in summary(results):
        print(line)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        rows = json.dumps({"config": config, "rows": results}, indent=2)
        (Path(args.out) / "rows.json").write_text(rows + "\n")


if __name__ == "__main__":
    main()

"""``python -m rayconv.bench``: the paper's experiments (Yadan et al. 2013, section 4) as one command.

For each model and layout: start the actors, run ``--warmup`` steps, then time ``--steps`` steps on
synthetic ImageNet-shaped data (3 x 224 x 224, 1000 classes) and a few profiled steps that split the
step into compute, receive wait, all-reduce wait and exposed exchange time (profiled steps run eagerly,
synchronised around each wait, also where the timed steps replay a CUDA graph; peak memory is read
before them). In the same run the anchors are measured under
the same precision and global batch: plain PyTorch on 1 device and torchrun DDP on the layout's
devices (``rayconv.anchor``), each in the fastest of its candidate configurations (eager; compiled,
and for DDP compile(DDP) and DDP(compile), on GPUs; DDP's bucket settings), the winner named in the
row. ``--data imagefolder --data-dir DIR`` reads real JPEG files through the loader instead of
synthetic data, so that each row's input stall shows (the anchors then do not run). Writes into ``--out``:

* ``bench.parquet``: one row per (model, layout): images_per_s, step_ms, speedup over rayconv on 1
  device, ratios to the anchors, peak memory per device (GiB), parameters per actor, compute /
  receive-wait / all-reduce-wait / driver-idle time per step (ms), ``exchange_exposed_ms``: the time a
  step waits for filter split's (or the per-layer plan's) activation exchanges, the part compute did
  not hide (with ``--exchange-chunks 1`` every exchange is waited for, so the ``fs2`` row's figure is
  the exchanges' whole time and ``fs2c4``'s the part 4 overlapped pieces leave exposed), input stall per step (ms, the wait
  for a batch not overlapped with compute, and its fraction of the step), communication volume per step
  (``comm_mb_per_step``: MB, 2**20 bytes, the most any actor hands to torch.distributed in a step,
  sends and collectives' inputs as ``parallel/comm.py`` defines them; ``comm_mb_per_step_total``: all
  actors together), pipeline bubble fraction, and the
  driver's overhead: the timed steps run again with each actor looping by itself (one call,
  ``in_actor_step_ms``), and ``driver_overhead`` = 1 - (that time / the driver loop's time), the share
  of a step the driver's per-step calls cost (noise can make it slightly negative);
* ``bench.md``: the Markdown table; ``speedup.png``: bars of speedup over 1 device.

A layout that fails (out of memory, an actor's error, a call to the actors past ``--call-timeout-s``)
keeps its row, with nulls where nothing was measured and ``note`` naming the phase and the error; the
bench goes on with the next layout. Rows are written after each layout.

``--sweep batch`` measures images/s and peak memory over per-device batch sizes 16..1024 (until one
does not fit); ``--sweep memory`` keeps doubling the batch until it does not fit (the largest
trainable batch per layout, to within a factor of 2);
``--curve`` trains each layout on the real digits data and plots test error against wall-clock time
(the paper's Figure 1). Layout names: ``1gpu``, ``dp2``, ``fs2``, ``pp2`` (``pp2m4`` fixes 4
micro-batches; plain ``pp2`` tries 2, 4 and 8 and keeps the fastest; ``pp2m4v2`` interleaves 2 model
chunks per stage), ``fs2c4`` (filter split with each gather in 4 overlapped batch pieces,
``--exchange-chunks 4``), ``plan2`` (Krizhevsky 2014's
per-layer plan on 2 actors), and products such as ``dp2xfs2``, ``dp2xpp2``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from rayconv.bench import anchor
from rayconv.cluster import group as cluster
from rayconv.errors import CallTimeout, ClusterError
from rayconv.config import Config, ConfigError, OneLineParser
from rayconv.data.registry import make_source
from rayconv.errors import DataError
from rayconv.driver.job import call_timeout_s as default_call_timeout_s, fit, launch, prepare
from rayconv.outputs.charts import error_against_time, pyplot
from rayconv.files import atomic_write
from rayconv.parallel.pipeline.validate import bubble_fraction


MAX_CALL_TIMEOUT_S = 7 * 24 * 3600.0  # --call-timeout-s: a week (Ray's wait takes no infinite limit)


def parse_layout(name: str) -> dict[str, Any]:
    """``dp2xfs2`` -> {"dp": 2, "fs": 2}; ``1gpu`` -> {"dp": 1}; ``plan4`` -> plan over 4 actors;
    ``pp2m4`` -> pp=2 with 4 micro-batches; ``pp2m4v2`` -> the same, interleaved, 2 model chunks per
    stage; ``fs2c4`` -> fs=2 with each gather in 4 overlapped pieces. Raises ConfigError for anything else."""
    name, _, schedule = name.partition("-")
    if schedule and schedule not in ("gpipe", "1f1b"):
        raise ConfigError(f"unknown schedule {schedule!r} in layout {name}-{schedule}: use -gpipe or -1f1b")
    if name in ("1gpu", "1"):
        return {"dp": 1}
    out: dict[str, Any] = {"schedule": schedule} if schedule else {}
    for part in name.split("x"):
        m = re.fullmatch(r"(dp|pp|fs|plan)(\d+)(?:m(\d+))?(?:v(\d+))?(?:c(\d+))?", part)
        if not m or ((m.group(3) or m.group(4)) and m.group(1) != "pp") or (m.group(5) and m.group(1) != "fs"):
            raise ConfigError(f"unknown layout {name!r}: use e.g. 1gpu, dp2, fs2, fs2c4, pp2, pp2m4, pp2m4-gpipe, "
                              "pp2m4v2, plan2, dp2xfs2")
        axis, n = m.group(1), int(m.group(2))
        if n == 0 or any(g is not None and int(g) == 0 for g in m.groups()[2:]):
            raise ConfigError(f"layout {name!r} has a zero count: every degree, micro-batch, chunk and piece "
                              "count is at least 1")
        if axis == "plan":
            out.update(dp=n, plan="krizhevsky2014")
        else:
            out[axis] = n
        if m.group(3):
            out["num_microbatches"] = int(m.group(3))
        if m.group(4):
            out["virtual_stages"] = int(m.group(4))
        if m.group(5):
            out["exchange_chunks"] = int(m.group(5))
    out.setdefault("dp", 1)
    return out


def layout_size(name: str) -> int:
    lay = parse_layout(name)
    return lay.get("dp", 1) * lay.get("pp", 1) * lay.get("fs", 1)


def measure(cfg: Config, warmup: int, steps: int, profile_steps: int = 3, trace_steps: int = 0,
            trace_to: Optional[Path] = None, call_timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Images/s and step time of ``cfg`` over ``steps`` timed steps after ``warmup`` steps, then a
    profiled split, then (``trace_steps`` > 0) a torch.profiler trace of rank 0 written as a table to
    ``trace_to``.

    Every call to the actors (one step, or the in-actor loop of ``steps`` steps) must return within
    ``call_timeout_s`` seconds (default ``driver.call_timeout_s(cfg)``, as ``rayconv.run``);
    otherwise the actors are stopped. Raises ClusterError (out of memory, an actor's error) or its
    subclass CallTimeout (a call past its limit), the message prefixed with the phase it happened in
    (e.g. ``warm-up step 0``)."""
    mesh, source, plan = prepare(cfg)
    limit = call_timeout_s if call_timeout_s is not None else default_call_timeout_s(cfg)
    gang, setups = launch(cfg, mesh, plan, f"bench-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    compiles = bool(setups[0].get("compiled"))
    phase = "warm-up step 0"
    try:
        t0 = time.perf_counter()
        first_step_s = None
        for s in range(warmup):
            phase = f"warm-up step {s}" + (" (compiles)" if s == 0 and compiles else "")
            gang.call("train_step", s, cfg.lr, timeout_s=limit)  # (one at a time: compile and autotuning here)
            if s == 0:
                gang.call("flush", timeout_s=limit)
                first_step_s = time.perf_counter() - t0
        gang.call("flush", timeout_s=limit)
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = []
        in_flight = gang.submit("train_step", warmup, cfg.lr)
        for s in range(warmup, warmup + steps):  # as the driver's loop: the next step queued before waiting
            phase = f"timed step {s}"
            current, in_flight = in_flight, (gang.submit("train_step", s + 1, cfg.lr) if s + 1 < warmup + steps else None)
            results.append(gang.collect(current, timeout_s=limit))
        results.append(gang.call("flush", timeout_s=limit))
        elapsed = time.perf_counter() - t0
        # Driver overhead: per step, the least time any actor waited for the driver's next call (the
        # actor that finished last waited only for the driver's round trip).
        idle = [min(r["idle_ms"] for r in rs) for rs in results
                if rs and all(r is not None and r.get("idle_ms") is not None for r in rs)]
        # Input stall per step: the longest wait for a batch not overlapped with compute (steptime.py).
        stalls = [max(r.get("input_stall_ms") or 0.0 for r in rs) for rs in results
                  if rs and all(r is not None for r in rs)]
        # The same steps with no driver call between them (each actor loops by itself; one call).
        phase = f"in-actor loop of {steps} steps"
        t1 = time.perf_counter()
        gang.call("train_steps", warmup + steps, steps, cfg.lr, timeout_s=limit)
        in_actor_s = time.perf_counter() - t1
        # Peak memory of the timed steps (the profiled ones below run eagerly, outside any CUDA graph).
        phase = "memory report"
        memory = gang.call("memory", timeout_s=limit)
        first_prof = warmup + 2 * steps
        prof = []
        for s in range(first_prof, first_prof + profile_steps):
            phase = f"profiled step {s}"
            gang.call("train_step", s, cfg.lr, True, timeout_s=limit)
            prof.append(gang.call("flush", timeout_s=limit))
        device_busy = None
        if trace_steps:
            phase = "trace"
            tr = gang.call("trace", first_prof + profile_steps, trace_steps, cfg.lr, timeout_s=limit)[0]
            if tr["device_ms"] is not None:
                device_busy = tr["device_ms"] / tr["wall_ms"]
            if trace_to is not None:
                kernels = "not measured" if tr["device_ms"] is None else f"{tr['device_ms']:.1f} ms"
                atomic_write(trace_to, lambda tmp: Path(tmp).write_text(
                    f"rank 0, {trace_steps} steps, wall {tr['wall_ms']:.1f} ms (with the profiler's own overhead), "
                    f"device kernels {kernels}\n{tr['table']}\n"))
    except CallTimeout as e:
        raise CallTimeout(f"{phase}: {e}; if it is only slow, raise --call-timeout-s", recoverable=True) from e
    except ClusterError as e:
        raise ClusterError(f"{phase}: {e}", recoverable=e.recoverable) from e
    finally:
        gang.kill()
    step_ms = elapsed / steps * 1e3

    def mean_of(key: str) -> Optional[float]:
        vals = [max(r[key] for r in rs) for rs in prof if rs and rs[0].get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    # Communication volume of a step (the last profiled one; every step of a run sends the same), in MB
    # (2**20 bytes): the most any actor handed to torch.distributed, and all actors together.
    sent = [r.get("comm_bytes") for r in (prof[-1] if prof else None) or []]
    known = sent and all(b is not None for b in sent)
    peaks = [m["peak_gib"] for m in memory]
    return {
        "images_per_s": cfg.global_batch_size * steps / elapsed, "step_ms": step_ms, "warmup_s": warmup_s,
        "first_step_s": first_step_s, "compiled": bool(setups[0].get("compiled")),
        "cuda_graphs": bool(setups[0].get("cuda_graphs")),
        "peak_gib_max": max(peaks) if all(p is not None for p in peaks) else None,
        "peak_gib_per_actor": json.dumps([None if p is None else round(p, 3) for p in peaks]),
        "params_per_actor": json.dumps([s["parameters"] for s in setups]),
        "compute_ms": mean_of("compute_ms"), "recv_wait_ms": mean_of("wait_ms"),
        "allreduce_wait_ms": mean_of("allreduce_ms"), "exchange_exposed_ms": mean_of("exchange_ms"),
        "driver_idle_ms": sum(idle) / len(idle) if idle else None,
        "input_stall_ms": sum(stalls) / len(stalls) if stalls else None,
        "input_stall_fraction": sum(stalls) / len(stalls) / step_ms if stalls else None,
        "comm_mb_per_step": max(sent) / 2**20 if known else None,
        "comm_mb_per_step_total": sum(sent) / 2**20 if known else None,
        "in_actor_step_ms": in_actor_s / steps * 1e3, "driver_overhead": 1 - in_actor_s / elapsed,
        "device_busy": device_busy,
        "bubble_fraction": bubble_fraction(plan.schedule) if mesh.pp > 1 else 0.0,
        "num_microbatches": cfg.num_microbatches, "schedule": cfg.schedule if mesh.pp > 1 else None,
        "virtual_stages": cfg.virtual_stages, "exchange_chunks": cfg.exchange_chunks if mesh.fs > 1 else None,
        "world_size": mesh.world_size,
    }


def run_anchor(model: str, devices: int, global_batch: int, args) -> Optional[dict[str, Any]]:
    """Plain PyTorch (devices == 1) or torchrun DDP (devices > 1) at the same global batch, in its
    fastest configuration (``rayconv.anchor`` times each candidate: eager ones, and when this run
    compiles also the torch.compile ones). The result's ``config`` names the winner and
    ``candidates`` gives every candidate's images/s (None where it failed). Past ``--anchor-timeout``
    the fastest of the candidates timed so far counts. None if no candidate ran."""
    per_device = global_batch // devices
    base = ["-m", "rayconv.anchor", "--model", model, "--batch", str(per_device), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--precision", "bf16" if args.precision == "bf16" else "fp32",
            "--device", args.device_kind, "--image-size", str(args.image_size)]
    base += ["--compile"] if compiles(args) else []
    if devices == 1:
        cmd = [sys.executable, *base]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}",
               *base, "--ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.anchor_timeout, env=env)
        stdout, stderr = out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = f"past --anchor-timeout {args.anchor_timeout:g} s"
    timed = []
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if line.startswith("CANDIDATE "):
            timed.append(json.loads(line[len("CANDIDATE "):]))
    best = anchor.pick_fastest(timed)
    if best is not None:  # cut short: the fastest of those timed
        return {**best, "candidates": {r["config"]: r.get("images_per_s") for r in timed}}
    print(f"anchor failed ({' '.join(cmd)}):\n{stderr[-2000:]}", file=sys.stderr)
    return None


def compiles(args) -> bool:
    """Whether the anchors also time their torch.compile configurations (the fastest of all counts): on
    GPUs unless ``--compile off`` (rayconv itself compiles as its ``--compile`` rule says)."""
    return args.compile == "on" or (args.compile == "auto" and args.device_kind == "cuda")


def base_config(args, model: str, layout: dict[str, Any], global_batch: int) -> Config:
    data = dict(data="synthetic", num_classes=1000, synthetic_samples=max(global_batch * 4, 1024)) \
        if args.data == "synthetic" else \
        dict(data=args.data, data_dir=args.data_dir, loader_workers=args.loader_workers, decode=args.decode)
    kw: dict[str, Any] = dict(model=model, **data, image_size=args.image_size, global_batch_size=global_batch,
                              precision=args.precision, device=args.device, address=args.address,
                              progress=False, lr=0.01, compile=args.compile,
                              cuda_graphs=args.cuda_graphs, all_gpus_visible=args.all_gpus_visible)
    kw.update(layout)
    return Config(**kw).validate()


# bench.parquet's columns. Every row has all of them: a layout that failed keeps its row, with nulls
# where nothing was measured and ``note`` saying why. (Inferred from the rows instead, the columns
# would be the first row's keys only, and a failed first layout would drop every measured column.)
_F, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()
BENCH_SCHEMA = pa.schema([
    ("model", _S), ("layout", _S), ("global_batch_size", _I), ("image_size", _I), ("note", _S),
    ("images_per_s", _F), ("step_ms", _F), ("warmup_s", _F), ("first_step_s", _F), ("compiled", _B),
    ("cuda_graphs", _B), ("peak_gib_max", _F), ("peak_gib_per_actor", _S), ("params_per_actor", _S),
    ("compute_ms", _F), ("recv_wait_ms", _F), ("allreduce_wait_ms", _F), ("exchange_exposed_ms", _F),
    ("driver_idle_ms", _F),
    ("comm_mb_per_step", _F), ("comm_mb_per_step_total", _F),
    ("in_actor_step_ms", _F), ("driver_overhead", _F), ("device_busy", _F), ("bubble_fraction", _F),
    ("input_stall_ms", _F), ("input_stall_fraction", _F), ("data", _S),
    ("num_microbatches", _I), ("schedule", _S), ("virtual_stages", _I), ("exchange_chunks", _I),
    ("world_size", _I),
    ("speedup_vs_1", _F), ("plain_pytorch_images_per_s", _F), ("plain_pytorch_config", _S),
    ("plain_pytorch_candidates", _S), ("vs_plain_pytorch", _F), ("torchrun_ddp_images_per_s", _F),
    ("torchrun_ddp_config", _S), ("torchrun_ddp_candidates", _S), ("vs_torchrun_ddp", _F),
])


def bench_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as a table of ``BENCH_SCHEMA`` (missing values null). Raises ValueError for a key the
    schema lacks (it would be dropped silently)."""
    unknown = sorted({k for r in rows for k in r} - set(BENCH_SCHEMA.names))
    if unknown:
        raise ValueError(f"bench rows have columns missing from BENCH_SCHEMA: {unknown}")
    return pa.Table.from_pylist(rows, schema=BENCH_SCHEMA)


def write_table(rows: list[dict[str, Any]], out: Path) -> None:
    table = bench_table(rows)
    atomic_write(out / "bench.parquet", lambda tmp: pq.write_table(table, tmp))
    cols = ["model", "layout", "global_batch_size", "images_per_s", "step_ms", "speedup_vs_1",
            "vs_plain_pytorch", "vs_torchrun_ddp", "peak_gib_max", "compute_ms", "recv_wait_ms",
            "allreduce_wait_ms", "exchange_exposed_ms", "comm_mb_per_step", "driver_idle_ms", "in_actor_step_ms", "driver_overhead",
            "device_busy", "bubble_fraction", "input_stall_ms", "input_stall_fraction", "note"]

    def fmt(v: Any) -> str:
        if v is None:
            return "not measured"
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else (f"{v:.0f}" if isinstance(v, float) else str(v))

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    atomic_write(out / "bench.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if r.get("speedup_vs_1") is not None]
    if not rows:
        (out / "speedup.png").unlink(missing_ok=True)  # not an older run's chart beside this table
        return
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.7), 4))
    labels = [f"{r['model']}\n{r['layout']}\nB={r['global_batch_size']}" for r in rows]
    ax.bar(range(len(rows)), [r["speedup_vs_1"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speedup over rayconv on 1 device")
    size = rows[0].get("image_size", 224)
    ax.set_title(f"rayconv speedups (same run, synthetic {size}x{size})")
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


def main_bench(args) -> list[dict[str, Any]]:
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    layouts = args.layouts.split(",")
    jobs = [(m, b, lay) for m in args.models.split(",") for b in args.global_batch_size for lay in layouts]
    bar = tqdm(total=len(jobs), desc="bench", unit="layout", disable=not sys.stderr.isatty())  # logs: RESULT lines
    single: dict[tuple[str, int], float] = {}
    anchors: dict[tuple[str, int, int], Optional[dict[str, Any]]] = {}
    for model, gb, name in jobs:
        bar.set_postfix_str(f"{model} {name} B={gb}")
        lay = parse_layout(name)
        row: dict[str, Any] = {"model": model, "layout": name, "global_batch_size": gb, "image_size": args.image_size,
                               "data": args.data, "note": "", "world_size": layout_size(name)}
        tries = [lay]
        if lay.get("pp", 1) > 1 and "num_microbatches" not in lay:
            tries = [{**lay, "num_microbatches": m} for m in (2, 4, 8) if gb // lay["dp"] % m == 0]
        best: Optional[dict[str, Any]] = None
        for t in tries:
            try:
                tag = f"{model}-{name}{'' if t is lay else 'm' + str(t['num_microbatches'])}-B{gb}"
                r = measure(base_config(args, model, t, gb), args.warmup, args.steps, trace_steps=args.trace,
                            trace_to=out / f"trace-{tag}.txt" if args.trace else None,
                            call_timeout_s=args.call_timeout_s)
            except (ClusterError, ValueError) as e:
                row["note"] = str(e).splitlines()[0][:200]
                continue
            if best is None or r["images_per_s"] > best["images_per_s"]:
                best = r
        if best is not None:
            row.update(best)
            if name in ("1gpu", "1"):
                single[(model, gb)] = best["images_per_s"]
        devices = layout_size(name)
        for n in {1, devices}:
            if args.anchors and args.data == "synthetic" and (model, gb, n) not in anchors:
                anchors[(model, gb, n)] = run_anchor(model, n, gb, args)
        one = single.get((model, gb))
        ips = row.get("images_per_s")
        row["speedup_vs_1"] = ips / one if ips and one else None
        a1, an = anchors.get((model, gb, 1)), anchors.get((model, gb, devices))
        row["plain_pytorch_images_per_s"] = a1["images_per_s"] if a1 else None
        # Which configuration was fastest, and every candidate's images/s (JSON).
        row["plain_pytorch_config"] = a1["config"] if a1 else None
        row["plain_pytorch_candidates"] = json.dumps(a1["candidates"]) if a1 else None
        row["torchrun_ddp_config"] = an["config"] if an and devices > 1 else None
        row["torchrun_ddp_candidates"] = json.dumps(an["candidates"]) if an and devices > 1 else None
        row["vs_plain_pytorch"] = ips / a1["images_per_s"] if ips and a1 else None
        row["torchrun_ddp_images_per_s"] = an["images_per_s"] if an and devices > 1 else None
        row["vs_torchrun_ddp"] = ips / an["images_per_s"] if ips and an and devices > 1 else None
        rows.append(row)
        write_table(rows, out)  # after every layout: a cut-short run keeps what it measured
        print(f"RESULT {model} {name} B={gb}: " + (f"{ips:.0f} images/s, speedup {ratio(row['speedup_vs_1'])}, "
              f"vs plain {ratio(row['vs_plain_pytorch'])}, vs DDP {ratio(row['vs_torchrun_ddp'])}"
              if ips else f"failed: {row['note']}"), flush=True)
        bar.update(1)
    bar.close()
    return rows


def ratio(v: Optional[float]) -> str:
    """A ratio for the RESULT lines: ``1.23x``, or ``not measured``."""
    return f"{v:.2f}x" if v else "not measured"


def sweep_batch(args, until_largest: bool) -> list[dict[str, Any]]:
    """Per-device batch --min-batch (16), doubling up to --max-batch for each layout (RQ4), stopping at the first that
    does not fit. With ``until_largest`` (``--sweep memory``, RQ5) the cap is lifted to 65536 unless
    --max-batch was given, so each layout doubles until it runs out of memory: the last row that fits is
    its largest trainable batch (to within a factor of 2)."""
    if until_largest and args.max_batch == 1024:
        args.max_batch = 65536
    out = Path(args.out)
    rows = []
    path = out / ("sweep_memory.parquet" if until_largest else "sweep_batch.parquet")
    for model in args.models.split(","):
        for name in args.layouts.split(","):
            n = layout_size(name)
            per = args.min_batch
            while per <= args.max_batch:
                gb = per * (parse_layout(name)["dp"] if "plan" not in name else n)
                try:
                    # 3 warm-up steps: on GPUs, 2 eager steps and the one CUDA graph capture
                    r = measure(base_config(args, model, parse_layout(name), gb), 3, max(3, args.steps // 4), 0,
                                call_timeout_s=args.call_timeout_s)
                    rows.append({"model": model, "layout": name, "batch_per_device": per, "global_batch_size": gb,
                                 "fits": True, "images_per_s": r["images_per_s"], "peak_gib_max": r["peak_gib_max"],
                                 "note": None})
                except (ClusterError, ValueError) as e:
                    rows.append({"model": model, "layout": name, "batch_per_device": per, "global_batch_size": gb,
                                 "fits": False, "images_per_s": None, "peak_gib_max": None,
                                 "note": str(e).splitlines()[0][:200]})
                    break
                finally:  # after every batch: a cut-short sweep keeps what it measured
                    if rows:
                        table = pa.Table.from_pylist(rows)
                        atomic_write(path, lambda tmp: pq.write_table(table, tmp))
                print(f"SWEEP {model} {name} per-device {per}: {r['images_per_s']:.0f} images/s, "
                      f"{r['peak_gib_max']} GiB", flush=True)
                per *= 2
    return rows


def training_curve(args) -> list[dict[str, Any]]:
    """Test error against wall-clock time for each layout on the real digits data (Figure 1); with
    ``--global-batch-size`` given, for each of its batch sizes (RQ4's convergence against batch)."""
    out = Path(args.out)
    rows = []
    curves = [(b, name) for b in args.curve_batches for name in args.layouts.split(",")]
    for gb, name in curves:
        label = name if gb is None else f"{name} B={gb}"
        cfg = Config(**{**dict(model="convnet", data="digits", epochs=args.curve_epochs, device=args.device,
                               address=args.address, progress=False, eval_every=5, compile=args.compile,
                               cuda_graphs=args.cuda_graphs,
                               out=str(out / f"curve-{name}" if gb is None else out / f"curve-{name}-B{gb}")),
                        **({} if gb is None else {"global_batch_size": gb}), **parse_layout(name)}).validate()
        shutil.rmtree(cfg.out, ignore_errors=True)
        fit(cfg, log=lambda *_: None)
        table = pq.read_table(Path(cfg.out) / "metrics.parquet").to_pylist()
        evals = [{"layout": name, "global_batch_size": cfg.global_batch_size, "label": label, "time_s": r["time_s"],
                  "step": r["step"], "test_error": r["test_error"]} for r in table if r["kind"] == "eval"]
        rows += evals
        if evals:
            print(f"CURVE {label}: test error {evals[-1]['test_error']:.4f} after {evals[-1]['time_s']:.1f} s "
                  f"({evals[-1]['step'] + 1} steps)", flush=True)
    atomic_write(out / "curve.parquet", lambda tmp: pq.write_table(pa.Table.from_pylist(rows), tmp))
    error_against_time(rows, "label", "test error vs time, digits (Yadan et al. 2013, Fig. 1)", out / "curve.png")
    return rows


def parse_args(argv=None):
    p = OneLineParser(prog="python -m rayconv.bench", description=__doc__.split("\n")[0].replace("``", ""))
    p.add_argument("--layouts", default="1gpu,dp2,fs2,pp2,plan2",
                   help="comma-separated layout names, e.g. 1gpu, dp2, fs2, fs2c4 (each gather in 4 overlapped "
                        "pieces), pp2 (tries 2, 4, 8 micro-batches), pp2m4, pp2m4-gpipe, pp2m4v2 (interleaved), plan2, "
                        "dp2xfs2 (default %(default)s)")
    p.add_argument("--models", default="alexnet,resnet50",
                   help="comma-separated: alexnet, resnet50, any torchvision classification model, or convnet "
                        "(default %(default)s)")
    p.add_argument("--global-batch-size", default=None,
                   help="comma-separated, e.g. 256,1024 (default 256; with --curve: one curve per batch size, "
                        "default rayconv.run's)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per layout (default %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first; the first compiles on GPUs (default %(default)s)")
    p.add_argument("--image-size", type=int, default=224,
                   help="images are 3 x S x S (synthetic; image folders are cropped to S) (default %(default)s)")
    p.add_argument("--data", default="synthetic", choices=("synthetic", "imagefolder", "shards"),
                   help="synthetic: made on the device (no input cost); imagefolder: --data-dir's JPEG files "
                        "through the real loader, so input stall shows; shards: a folder written by "
                        "python -m rayconv.prepare (anchors: synthetic only, not run) (default %(default)s)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="with --data imagefolder: DIR/train/<class>/*.JPEG and DIR/val/<class>/*.JPEG "
                        "(benchmarks/make_images.py writes one); with --data shards: rayconv.prepare's --out")
    p.add_argument("--loader-workers", type=int, default=None,
                   help="decode processes per actor for --data imagefolder and shards decoded on the CPU "
                        "(default: as rayconv.run, the node's CPU cores per GPU less 2 on GPUs, 2 on CPUs)")
    p.add_argument("--decode", default="auto", choices=("auto", "cpu", "gpu"),
                   help="where --data shards decodes JPEGs: cpu (--loader-workers processes), gpu (nvJPEG on "
                        "the actors' GPUs); auto: cpu (default %(default)s)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="bf16: bf16 autocast with fp32 weights, for rayconv and the anchors (default %(default)s)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: GPUs when the Ray cluster has them, else CPU actors (default %(default)s)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, a running local cluster, or a new local one)")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="rayconv's --compile for every layout (auto: GPU layouts); unless off, the anchors "
                        "also time their torch.compile configurations on GPUs (on: on CPU too) and the fastest counts")
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                   help="rayconv's --cuda-graphs for every layout (auto: whole-step CUDA graphs on GPUs)")
    p.add_argument("--all-gpus-visible", action=argparse.BooleanOptionalAction, default=True,
                   help="actors see every GPU of their node (rayconv's default, as torchrun)")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="also profile N steps of each layout with torch.profiler and N more with cProfile (the "
                        "actors' Python side): trace-<layout>.txt, device_busy")
    p.add_argument("--anchors", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the anchors, plain PyTorch on 1 device and torchrun DDP on the layout's devices, "
                        "each in its fastest configuration (python -m rayconv.anchor) (default on)")
    p.add_argument("--anchor-timeout", type=float, default=1800, metavar="S",
                   help="seconds each anchor run (all its candidate configurations) may take; past it the fastest "
                        "candidate timed so far counts (default %(default)g)")
    p.add_argument("--call-timeout-s", type=float, default=None, metavar="S",
                   help="stop a layout when one call to its actors takes longer than S seconds (a warm-up step, "
                        "the first of which compiles on GPUs; a timed step; or the in-actor loop of all --steps steps), note "
                        "why in its row and go on to the next (default 630 = 2 x rayconv.run's --collective-timeout-s "
                        "300 + 30, as rayconv.run)")
    p.add_argument("--sweep", choices=("batch", "memory"), default=None,
                   help="batch: images/s and peak memory over per-device batches 16..--max-batch; memory: double "
                        "the batch until it does not fit (default: neither, the layout table)")
    p.add_argument("--min-batch", type=int, default=16, help="first per-device batch of a sweep (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=1024,
                   help="largest per-device batch of --sweep batch (default %(default)s; --sweep memory: 65536)")
    p.add_argument("--curve", action="store_true", help="test error vs wall-clock time on digits")
    p.add_argument("--curve-epochs", type=int, default=5, help="epochs of each --curve run (default %(default)s)")
    p.add_argument("--out", default="benchmarks/latest", help="folder for the results (default %(default)s)")
    args = p.parse_args(argv)
    given = args.global_batch_size is not None
    try:
        args.global_batch_size = [int(b) for b in str(args.global_batch_size or 256).split(",")]
    except ValueError:
        p.error(f"--global-batch-size {args.global_batch_size}: give comma-separated whole numbers, e.g. 256,1024")
    args.curve_batches = args.global_batch_size if given else [None]
    if args.min_batch < 1:
        p.error(f"--min-batch {args.min_batch}: give a per-device batch of at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        for name in args.layouts.split(","):
            parse_layout(name)
        if args.call_timeout_s is not None and not 0 < args.call_timeout_s <= MAX_CALL_TIMEOUT_S:
            raise ConfigError(f"--call-timeout-s {args.call_timeout_s:g}: give a positive number of seconds up to "
                              f"{MAX_CALL_TIMEOUT_S:g} (or leave it out for the default, 630)")
        if args.data != "synthetic":  # the data settings and folder, checked as rayconv.run checks them
            make_source(Config(data=args.data, data_dir=args.data_dir, loader_workers=args.loader_workers,
                               decode=args.decode, image_size=args.image_size, device=args.device).validate())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        cluster.connect(args.address)
        args.device_kind, _ = cluster.available_devices(args.device)
        if args.sweep:
            sweep_batch(args, until_largest=args.sweep == "memory")
        elif args.curve:
            training_curve(args)
        else:
            rows = main_bench(args)
            if not any(r.get("images_per_s") for r in rows):
                print(f"rayconv.bench: error: no layout was measured (the note column of {args.out}/bench.md "
                      "says why)", file=sys.stderr)
                return 1
    except (ConfigError, DataError, ClusterError) as e:
        print(f"rayconv.bench: error: {e}", file=sys.stderr)
        return 2
    print(f"results in {args.out}")
    return 0



"""The report's tables and figures from the raw rows that ``benchmarks/paper.sh`` writes, and two helpers
of its ``input`` part. No GPU needed.

    python benchmarks/report.py report RUN_DIR             # RUN_DIR/report.md, batch.png, memory.png
    python benchmarks/report.py digits-folder DIR --size 64  # the digits as an ImageNet-layout PNG folder
    python benchmarks/report.py collect OUT.parquet NAME=RUN_DIR ...  # rayconv.run evals -> a curve

``report`` reads each part's Parquet rows (``speed/bench.parquet``, ``batch/sweep_batch.parquet``, ...),
leaves out the parts that were not run (their tables say "not measured") and writes one Markdown table
per research question of Yadan et al. 2013 (RQ1-RQ5) plus Figure 1's, in the order of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from rayconv.outputs.charts import error_against_time, pyplot

SPEED_PARTS = ("speed", "dp-mp", "dp-mp-2012", "dp-mp-resnet", "hybrid", "hybrid-resnet", "scale",
               "scale-resnet")
PAPER_LIMIT_GIB = 6.0  # the paper's GPU (NVIDIA GeForce GTX TITAN, 6 GB)


def rows_of(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist() if path.exists() else []


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "not measured"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def table(header: list[str], body: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in body]
    return "\n".join(lines)


def anchor_config(row: dict[str, Any], which: str) -> Optional[str]:
    """How the anchor ran: the configuration that was fastest among those timed (``<which>_config``)."""
    return row.get(f"{which}_config")


def speed_table(run: Path) -> str:
    rows = [r for part in SPEED_PARTS for r in rows_of(run / part / "bench.parquet")]
    one = {(r["model"], r["global_batch_size"]): r["images_per_s"] for r in rows
           if r["layout"] in ("1gpu", "1") and r.get("images_per_s")}
    body = []
    for r in rows:
        ips, base = r.get("images_per_s"), one.get((r["model"], r["global_batch_size"]))
        speedup = r.get("speedup_vs_1") or (ips / base if ips and base else None)
        body.append([r["model"], r["layout"], r["world_size"], r["global_batch_size"], ips, speedup,
                     r.get("vs_plain_pytorch"), anchor_config(r, "plain_pytorch"), r.get("vs_torchrun_ddp"),
                     anchor_config(r, "torchrun_ddp") if (r["world_size"] or 1) > 1 else None,
                     r.get("comm_mb_per_step"), r.get("comm_mb_per_step_total"), r.get("allreduce_wait_ms"),
                     r.get("recv_wait_ms"), r.get("peak_gib_max"), r.get("note") or ""])
    if not body:
        return "not measured (no speed part in this run)"
    return table(["model", "layout", "GPUs", "global batch", "images/s", "speedup vs 1 GPU",
                  "vs plain PyTorch", "plain PyTorch config", "vs torchrun DDP", "DDP config",
                  "comm MB/step (max actor)", "comm MB/step (all)", "all-reduce wait ms", "receive wait ms",
                  "peak GiB", "note"], body)


MP_PARTS = ("mp-overlap", "mp-overlap-2012", "mp-overlap-plan", "pp-bound")


def model_parallel_table(run: Path) -> str:
    """The mp-overlap and pp-bound parts: each layout against rayconv on 1 GPU in the same bench call,
    with what a step waits for (exposed exchanges, receives) and the schedule's bubble."""
    body = []
    for part in MP_PARTS:
        rows = rows_of(run / part / "bench.parquet")
        one = {(r["model"], r["global_batch_size"]): r["images_per_s"] for r in rows
               if r["layout"] in ("1gpu", "1") and r.get("images_per_s")}
        for r in rows:
            ips, base = r.get("images_per_s"), one.get((r["model"], r["global_batch_size"]))
            body.append([part, r["model"], r["layout"], r["global_batch_size"], r.get("exchange_chunks"), ips,
                         ips / base if ips and base else None, r.get("step_ms"), r.get("compute_ms"),
                         r.get("exchange_exposed_ms"), r.get("recv_wait_ms"), r.get("bubble_fraction"),
                         r.get("peak_gib_max"), r.get("note") or ""])
    if not body:
        return "not measured (no mp-overlap or pp-bound part in this run)"
    return table(["part", "model", "layout", "global batch", "pieces per gather", "images/s",
                  "speedup vs 1 GPU (same call)", "step ms", "compute ms (profiled, eager)",
                  "exposed exchange ms", "receive wait ms", "ideal bubble", "peak GiB", "note"], body)


def batch_table(run: Path, plt) -> str:
    rows = rows_of(run / "batch" / "sweep_batch.parquet")
    if not rows:
        return "not measured (no batch part in this run)"
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in dict.fromkeys((r["model"], r["layout"]) for r in rows):
            pts = [r for r in rows if (r["model"], r["layout"]) == key and r["fits"]]
            ax.plot([p["batch_per_device"] for p in pts], [p["images_per_s"] for p in pts], marker="o",
                    label=" ".join(key))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch per GPU")
        ax.set_ylabel("images/s")
        ax.legend()
        ax.set_title("RQ4: throughput against batch per GPU")
        fig.tight_layout()
        fig.savefig(run / "batch.png", dpi=120)
        plt.close(fig)
    return table(["model", "layout", "batch per GPU", "global batch", "images/s", "peak GiB", "note"],
                 [[r["model"], r["layout"], r["batch_per_device"], r["global_batch_size"], r["images_per_s"],
                   r["peak_gib_max"], r["note"] or ""] for r in rows])


def convergence_table(run: Path) -> str:
    rows = rows_of(run / "convergence" / "curve.parquet")
    if not rows:
        return "not measured (no convergence part in this run)"
    body = []
    for gb in dict.fromkeys(r["global_batch_size"] for r in rows):
        pts = [r for r in rows if r["global_batch_size"] == gb]
        best = min(pts, key=lambda r: r["test_error"])
        body.append([gb, pts[-1]["step"] + 1, pts[-1]["time_s"], pts[-1]["test_error"], best["test_error"]])
    return table(["global batch (1 GPU)", "steps", "time s", "final test error", "best test error"], body)


def memory_table(run: Path, plt) -> str:
    rows = rows_of(run / "batch" / "sweep_batch.parquet") + rows_of(run / "memory" / "sweep_memory.parquet")
    if not rows:
        return "not measured (no batch or memory part in this run)"
    body = []
    for key in dict.fromkeys((r["model"], r["layout"]) for r in rows):
        pts = sorted((r for r in rows if (r["model"], r["layout"]) == key),
                     key=lambda r: r["batch_per_device"])
        fit = [r for r in pts if r["fits"]]
        fails = [r for r in pts if not r["fits"]]
        in_six = [r for r in fit if r["peak_gib_max"] is not None and r["peak_gib_max"] <= PAPER_LIMIT_GIB]
        top = fit[-1] if fit else None
        body.append([
            *key, top and top["batch_per_device"], top and top["peak_gib_max"],
            fails[0]["batch_per_device"] if fails else f"none up to {top and top['batch_per_device']}",
            in_six[-1]["batch_per_device"] if in_six else None
        ])
    if plt is not None and any(r["peak_gib_max"] for r in rows):  # (CPU runs measure no device memory)
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in dict.fromkeys((r["model"], r["layout"]) for r in rows):
            pts = sorted((r for r in rows if (r["model"], r["layout"]) == key and r["peak_gib_max"]),
                         key=lambda r: r["batch_per_device"])
            ax.plot([p["batch_per_device"] for p in pts], [p["peak_gib_max"] for p in pts], marker="o",
                    label=" ".join(key))
        ax.axhline(PAPER_LIMIT_GIB, color="gray", ls="--", lw=0.8, label="6 GB (the paper's GPU)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch per GPU")
        ax.set_ylabel("peak memory per GPU (GiB)")
        ax.legend(fontsize=7)
        ax.set_title("RQ5: memory per GPU")
        fig.tight_layout()
        fig.savefig(run / "memory.png", dpi=120)
        plt.close(fig)
    return table(["model", "layout", "largest batch per GPU that trains", "its peak GiB",
                  "first that does not", "largest within 6 GiB"], body)


def curve_table(run: Path, part: str) -> str:
    rows = rows_of(run / part / "curve.parquet")
    if not rows:
        return f"not measured (no {part} part in this run)"
    ref = {r["step"]: r["test_error"] for r in rows if r["layout"] == "1gpu"}
    body = []
    for name in dict.fromkeys(r["layout"] for r in rows):
        pts = [r for r in rows if r["layout"] == name]
        common = [abs(r["test_error"] - ref[r["step"]]) for r in pts if r["step"] in ref]
        body.append([name, pts[-1]["step"] + 1, pts[-1]["time_s"], pts[-1]["test_error"],
                     "reference" if name == "1gpu" else (max(common) if common else None)])
    return table(["layout", "steps", "time s", "final test error",
                  "largest difference from 1 GPU at the same step"], body)


def report(run: Path) -> Path:
    """Writes RUN/report.md (and batch.png, memory.png with matplotlib); returns the report's path."""
    plt = pyplot()
    parts = [
        ("RQ1-RQ3: images/s per layout (speed, dp-mp, dp-mp-resnet, hybrid, scale)", speed_table(run)),
        (
            "Model parallelism with overlapped exchanges, pipelines at their bound (mp-overlap, pp-bound)",
            model_parallel_table(run),
        ),
        ("RQ4: throughput against batch per GPU (batch; figure batch.png)", batch_table(run, plt)),
        (
            "RQ4: convergence against batch, digits (convergence; figure convergence/curve.png)",
            convergence_table(run),
        ),
        ("RQ5: memory per GPU (batch, memory; figure memory.png)", memory_table(run, plt)),
        ("Figure 1, digits in memory (curve; figure curve/curve.png)", curve_table(run, "curve")),
        (
            (
                "Figure 1, digits as 64x64 PNG files through the image-folder loader (input; figure"
                " input/curve.png)"
            ),
            curve_table(run, "input"),
        ),
    ]
    text = f"# {run.name}\n\n" + "\n\n".join(f"## {title}\n\n{body}" for title, body in parts) + "\n"
    out = run / "report.md"
    out.write_text(text)
    return out


def digits_folder(root: Path, size: int) -> None:
    """scikit-learn's 1,797 digits as ``size`` x ``size`` RGB PNG files in an ImageNet-layout folder:
    ``root/train/<digit>/`` and ``root/val/<digit>/`` (every fifth image held out). Kept if complete."""
    from PIL import Image
    from sklearn.datasets import load_digits

    done = root / "complete.json"
    if done.exists() and json.loads(done.read_text()).get("size") == size:
        return
    digits = load_digits()
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if i % 5 == 0 else "train"
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (img * (255.0 / 16.0)).clip(0, 255).astype("uint8")
        Image.fromarray(pixels).resize((size, size), Image.BILINEAR).convert("RGB").save(folder / f"{i}.png")
    done.write_text(json.dumps({"size": size, "images": len(digits.images)}))


def collect(out: Path, runs: list[str]) -> None:
    """The eval rows of ``rayconv.run`` output folders (``NAME=DIR``) as one curve table, and its plot."""
    rows = []
    for spec in runs:
        name, _, folder = spec.partition("=")
        metrics = Path(folder) / "metrics.parquet"
        rows += [{"layout": name, "time_s": r["time_s"], "step": r["step"], "test_error": r["test_error"]}
                 for r in rows_of(metrics) if r["kind"] == "eval"]
    if not rows:
        sys.exit(f"report.py collect: no eval rows in {', '.join(runs)}: did the runs fail? (their log.txt)")
    pq.write_table(pa.Table.from_pylist(rows), out)
    error_against_time(rows, "layout", "test error vs time, digits as PNG files (image-folder loader)",
                       out.with_suffix(".png"))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/report.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="report.md, batch.png, memory.png of a paper.sh run folder")
    r.add_argument("run_dir", type=Path)
    d = sub.add_parser("digits-folder", help="the digits as an ImageNet-layout folder of PNG files")
    d.add_argument("dir", type=Path)
    d.add_argument("--size", type=int, default=64, help="side in pixels (default %(default)s)")
    c = sub.add_parser("collect", help="eval rows of rayconv.run folders as one curve.parquet and .png")
    c.add_argument("out", type=Path)
    c.add_argument("runs", nargs="+", metavar="NAME=DIR")
    args = p.parse_args(argv)
    if args.cmd == "report":
        if not args.run_dir.is_dir():
            p.error(f"{args.run_dir} is not a folder: give a paper.sh run folder (benchmarks/results/...)")
        print(report(args.run_dir))
    elif args.cmd == "digits-folder":
        if args.size < 8:
            p.error(f"--size {args.size}: give at least 8 (the digits are 8 x 8)")
        digits_folder(args.dir, args.size)
    else:
        collect(args.out, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

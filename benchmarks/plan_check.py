"""The planner's predictions against measurement: plan, then bench the same layouts, then compare.

    timeout 3000 python benchmarks/plan_check.py --model alexnet --global-batch-size 256,1024      # GPUs
    timeout 3000 python benchmarks/plan_check.py --model resnet50 --global-batch-size 256,512
    python benchmarks/plan_check.py --device cpu --model convnet --image-size 32 \\
        --global-batch-size 16 --top 3

For each global batch: ``python -m rayconv.plan ... --json`` ranks the layouts over the devices at
hand; ``python -m rayconv.bench`` then measures the ``--top`` K predicted layouts and ``1gpu`` (plus
any ``--layouts``) on the same synthetic data, precision and batch; one row per layout goes to
``<out>/plan_check.md`` and ``plan_check.json``: predicted and measured images/s, their ratio,
predicted and measured rank, predicted and measured peak memory per device (GiB, measured on CUDA
only), and the predicted split of the step. Exit status 0 when every layout was measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def parse_flags() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="alexnet")
    p.add_argument("--global-batch-size", default="256", help="comma-separated")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"),
                   help="default: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--top", type=int, default=4, help="predicted layouts to measure (default %(default)s)")
    p.add_argument("--layouts", default="", help="also measure these layouts (bench names, comma-separated)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--address", default=None)
    p.add_argument("--call-timeout-s", default=None, help="the bench's --call-timeout-s")
    p.add_argument("--out", default="benchmarks/latest/plan-check")
    return p.parse_args()


def predict(a: argparse.Namespace, gb: int, device: str, precision: str, out: Path,
            where: list[str]) -> tuple[dict, list[str]]:
    """``rayconv.plan --json`` for global batch ``gb``: the predictions by layout name (``1gpu`` for the
    single device) and the fitting layouts' names, best first."""
    plan_json = out / f"plan-B{gb}.json"
    run([sys.executable, "-m", "rayconv.plan", "--model", a.model, "--global-batch-size", str(gb), "--device",
         device, "--precision", precision, "--data", "synthetic", "--image-size", str(a.image_size),
         "--json", str(plan_json), *where])
    ranking = json.loads(plan_json.read_text())[0]
    preds = {r["layout"]: r for r in ranking["fits"]}
    if ranking["single"]:
        preds.setdefault("1gpu", ranking["single"])
    return preds, [r["layout"] for r in ranking["fits"]]


def measure(a: argparse.Namespace, gb: int, names: list[str], device: str, precision: str, out: Path,
            where: list[str]) -> dict:
    """``rayconv.bench`` over layouts ``names`` at global batch ``gb``: its rows by layout name (none for a
    layout that failed, or for all when the bench wrote no table)."""
    bench_out = out / f"bench-B{gb}"
    subprocess.run([sys.executable, "-m", "rayconv.bench", "--models", a.model, "--layouts", ",".join(names),
                    "--global-batch-size", str(gb), "--device", device, "--precision", precision,
                    "--image-size", str(a.image_size), "--steps", str(a.steps), "--warmup", str(a.warmup),
                    "--no-anchors", "--out", str(bench_out), *where,
                    # (a failed layout keeps its row)
                    *(["--call-timeout-s", a.call_timeout_s] if a.call_timeout_s else [])])
    table = (
        pq.read_table(bench_out / "bench.parquet").to_pylist()
        if (bench_out / "bench.parquet").exists()
        else []
    )
    return {r["layout"]: r for r in table}


def compare(model: str, gb: int, names: list[str], preds: dict, order: list[str],
            measured: dict) -> list[dict]:
    """One row per layout in ``names``: predicted against measured rank, images/s and peak memory."""
    got = sorted((n for n in names if (measured.get(n) or {}).get("images_per_s")),
                 key=lambda n: -measured[n]["images_per_s"])
    rows = []
    for n in names:
        pr, me = preds.get(n), measured.get(n) or {}
        ips = me.get("images_per_s")
        rows.append(
            {
                "model": model,
                "global_batch_size": gb,
                "layout": n,
                "predicted_rank": order.index(n) + 1 if n in order else None,
                "measured_rank": got.index(n) + 1 if n in got else None,
                "predicted_images_per_s": pr["images_per_s"] if pr else None,
                "measured_images_per_s": ips,
                "measured_over_predicted": ips / pr["images_per_s"] if pr and ips else None,
                "predicted_peak_gib": pr["peak_gib"] if pr else None,
                "measured_peak_gib": me.get("peak_gib_max"),
                "predicted_split_ms": (
                    {k: pr[k] for k in ("compute_ms", "exchange_ms", "allreduce_ms", "bubble_ms")}
                    if pr
                    else None
                ),
                "note": me.get("note") or "",
            }
        )
    return rows


def markdown(rows: list[dict]) -> list[str]:
    """The rows as a Markdown table's lines."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = ["| model | batch | layout | pred. rank | meas. rank | pred. img/s | meas. img/s | meas./pred. | "
             "pred. GiB | meas. GiB | note |", "|" + " --- |" * 11]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['global_batch_size']} | {r['layout']} | {f(r['predicted_rank'], 'd')} | "
            f"{f(r['measured_rank'], 'd')} | {f(r['predicted_images_per_s'], ',.0f')} | "
            f"{f(r['measured_images_per_s'], ',.0f')} | {f(r['measured_over_predicted'], '.2f')} | "
            f"{f(r['predicted_peak_gib'], '.2f')} | {f(r['measured_peak_gib'], '.2f')} | {r['note'][:60]} |")
    return lines


def main() -> int:
    a = parse_flags()
    import torch

    cuda = a.device == "cuda" or (a.device == "auto" and (torch.cuda.is_available() or a.address))
    precision = a.precision or ("bf16" if cuda else "fp32")
    device = "cuda" if cuda else "cpu"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    where = ["--address", a.address] if a.address else []
    rows = []
    for gb in [int(b) for b in a.global_batch_size.split(",")]:
        preds, order = predict(a, gb, device, precision, out, where)
        names = list(dict.fromkeys(order[:a.top] + ["1gpu"] + [n for n in a.layouts.split(",") if n]))
        rows += compare(a.model, gb, names, preds, order,
                        measure(a, gb, names, device, precision, out, where))
    (out / "plan_check.json").write_text(json.dumps(rows, indent=1))
    lines = markdown(rows)
    (out / "plan_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if sum(r["measured_images_per_s"] is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""RQ4 on Fashion-MNIST: the final test accuracy against the global batch, with linear scaling and warm-up.

    python benchmarks/rq4_fashion.py OUT_DIR [--data-dir DIR] [--batches 64,256,1024,4096]
        [--variant NAME="FLAGS"]... [--epochs 30]

Every run is ``python -m rayconv.run`` with ``RECIPE`` (torchvision ``resnet18`` at 32 pixels, ``--lr-scaling
linear``: ``--lr`` is per 256 images) and a variant's flags after it (later flags win), through
``rayconv.fit`` in one process, so Ray starts once. Rows: ``OUT_DIR/rq4.json`` (one per batch and variant:
final test top-1, steps, images/s, training seconds) and each run's folder ``OUT_DIR/<variant>-<batch>``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import rayconv
from rayconv.flags import read_settings

RECIPE = ("--data fashion-mnist --model resnet18 --image-size 32 --lr-scaling linear --lr-warmup-epochs 5 "
          "--lr-warmup-decay 0.01 --label-smoothing 0.1 --weight-decay 5e-4 --norm-weight-decay 0 "
          "--bias-weight-decay 0 --opt sgd_nesterov --lr 0.1 --augment pad-crop --random-erase 0.5 "
          "--precision bf16 --compile off --no-progress --log-every 100000")
VARIANTS = {"sgd": "", "lars": "--opt lars --lr 1.0"}


def _variant(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: write NAME=\"FLAGS\", e.g. lars=\"--opt lars --lr 1\"")
    return name, flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--data-dir", default=None, help="the four idx files (default: Debian's folder)")
    ap.add_argument("--batches", default="64,256,1024,4096", help="global batch sizes, comma-separated")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument(
        "--variant", type=_variant, action="append",
        help='NAME="FLAGS" added after the recipe (default: sgd="" and lars="--opt lars --lr 1.0")')
    args = ap.parse_args(argv)
    variants = args.variant or list(VARIANTS.items())
    batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, flags in variants:
        for batch in batches:
            run_dir = args.out / f"{name}-{batch}"
            argv_run = shlex.split(RECIPE) + ["--epochs", str(args.epochs)] + shlex.split(flags) + [
                "--global-batch-size", str(batch), "--out", str(run_dir)]
            if args.data_dir:
                argv_run += ["--data-dir", args.data_dir]
            t0 = time.perf_counter()
            settings = read_settings(argv_run)
            try:
                s = rayconv.fit(**settings, log=lambda *_: None)
            except Exception as e:  # (one bad variant leaves the others to run)
                print(f"rq4 {name} B={batch}: failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                      flush=True)
                continue
            row = {"variant": name, "flags": flags, "global_batch_size": batch, "epochs": settings["epochs"],
                   "steps": s["steps"], "test_accuracy": s["test_accuracy"],
                   "images_per_s": s["images_per_s"], "train_time_s": s["train_time_s"],
                   "wall_s": time.perf_counter() - t0}
            rows.append(row)
            print(f"rq4 {name} B={batch}: top-1 {row['test_accuracy']:.4f}, {row['steps']} steps, "
                  f"{row['images_per_s']:.0f} images/s, {row['wall_s']:.1f} s", flush=True)
            (args.out / "rq4.json").write_text(json.dumps({"recipe": RECIPE, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m rayconv.plan``: rank every layout by predicted images/s, with peak memory per device.

    python -m rayconv.plan --model alexnet --global-batch-size 256             # the GPUs of this machine
    python -m rayconv.plan --model resnet50 --global-batch-size 512 --address 10.0.0.5:6379
    python -m rayconv.plan --model alexnet --global-batch-size 256 --max-memory-gib 6   # the paper's TITAN
    python -m rayconv.plan --model alexnet --global-batch-size 256 --machine h200x8,2xh200x8   # predictions
    python -m rayconv.plan --device cpu --model convnet
    python -m rayconv.plan --model resnet18 --data shards --data-dir shards --global-batch-size 256

The command line of the planner, nothing else: the cost model is ``rayconv.planner.costmodel``, the
measurements ``rayconv.planner.measure``, the search ``rayconv.planner.search``. Exit status 2 for bad input,
one line; 1 when no layout fits.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from rayconv.choices import DATA_CHOICES, PRECISION_CHOICES
from rayconv.config import Config
from rayconv.data_dir import with_data_kind
from rayconv.errors import ConfigError, DataError
from rayconv.files import atomic_write
from rayconv.flags import OneLineParser
from rayconv.planner.links import MACHINES  # (plain Python: --help and argument errors stay torch-free)


def parse_args(argv: Optional[list[str]] = None):
    """The planner's arguments; argparse exits 2 with one line on a bad one."""
    p = OneLineParser(
        prog="python -m rayconv.plan", error_name="rayconv.plan",
        description="Rank rayconv's layouts by predicted images/s from measured layer and link times.")
    p.add_argument("--model", default="convnet",
                   help="model name, as rayconv.run's --model (default convnet)")
    p.add_argument("--global-batch-size", type=int, default=64, help="images per step (default 64)")
    p.add_argument(
        "--gpus", type=int, default=None,
        help="devices to lay out (default: the cluster's GPUs, or this machine's; on CPU 2 actors)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to measure on (layer times on one of its GPUs, "
                        "links between two of its actors)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when there is a GPU")
    p.add_argument("--precision", default=None, choices=PRECISION_CHOICES,
                   help="default: bf16 on GPUs, fp32 on CPU")
    p.add_argument(
        "--data",
        default=None,
        choices=DATA_CHOICES,
        help=(
            "the data to plan for, as rayconv.run's --data (its image shape and classes; default: "
            "digits (1x8x8) for convnet, synthetic ImageNet-shaped otherwise)"
        ),
    )
    p.add_argument("--data-dir", default=None,
                   help="the folder of --data imagefolder, shards or fashion-mnist, "
                        "as rayconv.run's --data-dir (without --data: what it holds)")
    p.add_argument(
        "--image-size", type=int, default=None,
        help="training image side in pixels, as rayconv.run's (default: the data's own; synthetic 224)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure anew, ignoring (and then replacing) the cached measurements")
    p.add_argument(
        "--max-memory-gib", type=float, default=None,
        help="keep only layouts whose predicted peak memory per device fits (6: Yadan et al.'s TITAN)")
    p.add_argument("--machine", default="", help=f"also predict for machines not at hand, comma-separated: "
                                                 f"{', '.join(MACHINES)}, or all (assumed link table)")
    p.add_argument("--top", type=int, default=15, help="rows of each table (default 15; 0: all)")
    p.add_argument("--json", default=None, help="also write the rankings to this JSON file")
    a = p.parse_args(argv)
    for flag, v in (("--global-batch-size", a.global_batch_size), ("--gpus", a.gpus)):
        if v is not None and v < 1:
            p.error(f"{flag} must be >= 1 (got {v})")
    if a.max_memory_gib is not None and a.max_memory_gib <= 0:
        p.error(f"--max-memory-gib must be > 0 (got {a.max_memory_gib:g})")
    machines = list(MACHINES) if a.machine == "all" else [m for m in a.machine.split(",") if m]
    bad = [m for m in machines if m not in MACHINES]
    if bad:
        p.error(f"unknown --machine {','.join(bad)}: choose from {', '.join(MACHINES)} or all")
    a.machine = machines
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    try:
        return _plan(a)
    except (ConfigError, DataError) as e:
        print(f"rayconv.plan: error: {e}", file=sys.stderr)
        return 2


def _plan(a) -> int:
    """Measure (or read from the cache), rank and print; the exit status. Raises ConfigError."""
    # The measurements import torch (and Ray with --address): only once the arguments are good.
    from rayconv.planner import search
    from rayconv.planner.measure import Measurements

    kind, slots = _devices(a)
    world = a.gpus or slots
    # --data-dir alone
    given = with_data_kind({"data_dir": a.data_dir, **({"data": a.data} if a.data else {})})
    data = given.get("data") or ("digits" if a.model.startswith("convnet") else "synthetic")
    cfg = Config(model=a.model, data=data, data_dir=a.data_dir, image_size=a.image_size,
                 global_batch_size=a.global_batch_size,
                 precision=a.precision or ("bf16" if kind == "cuda" else "fp32"), device=kind,
                 address=a.address).validate()
    use_cluster = a.address is not None
    meas = Measurements(search.plan_config(cfg), kind, use_cluster=use_cluster and kind == "cuda",
                        # progress: beside the tables
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    meas.load(remeasure=a.remeasure)
    t0 = time.perf_counter()
    where = "on the cluster" if use_cluster else "here"
    rankings = [search.search(meas, world, meas.links(world), a.max_memory_gib,
                              f"{a.model}, global batch {a.global_batch_size}, {cfg.precision}, {world} x "
                              f"{meas.state['device']} ({where})")]
    for key in a.machine:
        m = MACHINES[key]
        rankings.append(search.search(meas, m.gpus, m.links(), a.max_memory_gib,
                                      f"PREDICTION for {m.name} ({m.gpus} GPUs; layer times of "
                                      f"{meas.state['device']}, links assumed, not measured): {a.model}, "
                                      f"global batch {a.global_batch_size}"))
    meas.save()
    print("\n\n".join(r.table(a.top) for r in rankings))
    measured = ("; measured " + ", ".join(meas.measured) if meas.measured
                else ", all measurements from the cache")
    print(f"\n(planned in {time.perf_counter() - t0:.2f} s{measured}: {meas.path})")
    if meas.reused:
        print(meas.reused)
    print(
        "(images/s are predicted by a cost model from the layer times and links above, not measured; a run"
        " with --layout auto prints its prediction beside the images/s it measured)"
    )
    if a.json:
        _write_json(Path(a.json), rankings)
    return 0 if rankings[0].fits else 1


def _devices(a) -> tuple[str, int]:
    """(device kind, devices to lay out): the cluster's with --address, else this machine's (2 CPU
    actors on CPU). Raises ConfigError for --device cuda without a GPU."""
    if a.address is not None:
        from rayconv.cluster import connect as cluster  # (imports Ray: only with --address)

        cluster.connect(a.address)
        return cluster.available_devices(a.device)
    import torch  # (seconds: after the arguments are checked)

    if a.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but this machine has no GPU: give --address of a GPU cluster or "
                          "--device cpu")
    kind = "cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu"
    return kind, torch.cuda.device_count() if kind == "cuda" else 2


def _write_json(path: Path, rankings) -> None:
    """The rankings as JSON: per table its title, link source, the layouts that fit and those too big."""
    rows = [{"title": r.title, "links": r.links.source, "fits": [p.as_dict() for p in r.fits],
             "too_big": [p.as_dict() for p in r.too_big],
             "single": r.single.as_dict() if r.single else None} for r in rankings]
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(rows, indent=1)))


if __name__ == "__main__":
    sys.exit(main())

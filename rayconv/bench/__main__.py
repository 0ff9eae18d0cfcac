"""``python -m rayconv.bench``: the paper's experiments (Yadan et al. 2013, section 4) as one command.

For each model and layout: start the actors, run ``--warmup`` steps (the whole first epoch when it ends
in a partial batch, whose shape's one-time set-up is then not timed: ``bench.measure.warmup_steps``),
then time ``--steps`` steps on synthetic ImageNet-shaped data (3 x 224 x 224, 1000 classes) and a few
profiled steps that split the step into its costs (``bench.measure``). In the same run the anchors are
measured under the same precision and global batch: plain PyTorch on 1 device and torchrun DDP on the layout's
devices (``bench.anchor``), each in the fastest of its candidate configurations (eager; compiled, and for DDP
compile(DDP) and DDP(compile), on GPUs; DDP's bucket settings), the winner named in the row. ``--data
imagefolder --data-dir DIR`` reads real JPEG files through the loader instead of synthetic data, so that each
row's input stall shows (the anchors then do not run). Writes into ``--out`` (a folder, or a store's URI
such as ``s3://bucket/prefix``, as ``rayconv.run``'s ``--out``: each file whole or absent):

* ``bench.parquet``: one row per (model, layout): images_per_s, step_ms (and ``step_ms_median``: a mean
  well above the median is a few slow steps, such as epoch ends), speedup over rayconv on 1
  device, ratios to the anchors, peak memory per device (GiB), parameters per actor, compute /
  receive-wait / all-reduce-wait / driver-idle time per step (ms), ``exchange_exposed_ms``: the time a
  step waits for filter split's (or the per-layer plan's) activation exchanges, the part compute did
  not hide (with ``--exchange-chunks 1`` every exchange is waited for, so the ``fs2`` row's figure is
  the exchanges' whole time and ``fs2c4``'s the part 4 overlapped pieces leave exposed), input stall
  per step (ms, the wait for a batch not overlapped with compute, and its fraction of the step),
  communication volume per step (``comm_mb_per_step``: MB, 2**20 bytes, the most any actor hands to
  torch.distributed in a step, sends and collectives' inputs as ``parallel/comm.py`` defines them;
  ``comm_mb_per_step_total``: all actors together), pipeline bubble fraction, and the driver's
  overhead: the timed steps run again with each actor looping by itself (one call,
  ``in_actor_step_ms``), and ``driver_overhead`` = 1 - (that time / the driver loop's time), the share
  of a step the driver's per-step calls cost (noise can make it slightly negative);
* ``bench.md``: the Markdown table; ``speedup.png``: bars of speedup over 1 device (``bench.table``).

A layout that fails (out of memory, an actor's error, a call to the actors past ``--call-timeout-s``)
keeps its row, with nulls where nothing was measured and ``note`` naming the phase and the error; the
bench goes on with the next layout. Rows are written after each layout.

``--sweep batch`` measures images/s and peak memory over per-device batch sizes 16..1024 (until one
does not fit); ``--sweep memory`` keeps doubling the batch until it does not fit (the largest
trainable batch per layout, to within a factor of 2); ``--curve`` trains each layout on the real
digits data and plots test error against wall-clock time (the paper's Figure 1) (``bench.sweeps``);
with ``--target-accuracy A`` each curve run's time to test accuracy A goes into ``bench.parquet``.
Layout names are ``rayconv.layout``'s: ``1gpu``, ``dp2``, ``fs2``, ``pp2`` (``pp2m4`` fixes 4
micro-batches; plain ``pp2`` tries 2, 4 and 8 and keeps the fastest; ``pp2m4v2`` interleaves 2 model
chunks per stage), ``fs2c4`` (filter split with each gather in 4 overlapped batch pieces,
``--exchange-chunks 4``), ``plan2`` (Krizhevsky 2014's per-layer plan on 2 actors), and products
such as ``dp2xfs2``, ``dp2xpp2``. Exit status 0, 1 when no layout was measured, 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys

from rayconv.bench.sweeps import main_bench, sweep_batch, training_curve
from rayconv.cluster.connect import available_devices, connect
from rayconv.config import Config
from rayconv.data.registry import make_source
from rayconv.errors import ClusterError, ConfigError, DataError
from rayconv.flags import OneLineParser
from rayconv.layout import Layout
from rayconv.storage import describe, place
from rayconv.storage_checks import check_writable

MAX_CALL_TIMEOUT_S = 7 * 24 * 3600.0  # --call-timeout-s: a week (Ray's wait takes no infinite limit)


def _add_workload(p: argparse.ArgumentParser) -> None:
    """What is measured: layouts, models, batches, steps, data."""
    p.add_argument(
        "--layouts", default="1gpu,dp2,fs2,pp2,plan2",
        help="comma-separated layout names, e.g. 1gpu, dp2, fs2, fs2c4 (each gather in 4 overlapped "
        "pieces), pp2 (tries 2, 4, 8 micro-batches), pp2m4, pp2m4-gpipe, pp2m4v2 (interleaved), plan2, "
        "dp2xfs2 (default %(default)s)")
    p.add_argument(
        "--models", default="alexnet,resnet50",
        help="comma-separated: alexnet, resnet50, any torchvision classification model, or convnet "
        "(default %(default)s)")
    p.add_argument(
        "--global-batch-size", default=None,
        help="comma-separated, e.g. 256,1024 (default 256; with --curve: one curve per batch size, "
        "default rayconv.run's)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per layout (default %(default)s)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps first; the first compiles on GPUs; through the first epoch when it "
                        "ends in a partial batch (default %(default)s)")
    p.add_argument(
        "--image-size", type=int, default=224,
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
    p.add_argument(
        "--data-on-device", default="auto", choices=("auto", "on", "off"),
        help="as rayconv.run's: small imagefolder and shards data held on the device (auto, on) or "
        "read through the loader (off, which the input rows measure) (default %(default)s)")


def _add_runtime(p: argparse.ArgumentParser) -> None:
    """How rayconv runs: precision, devices, compilation, tracing, the call limit."""
    p.add_argument(
        "--precision", default="bf16", choices=("bf16", "fp32"),
        help="bf16: bf16 autocast with fp32 weights, for rayconv and the anchors (default %(default)s)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: GPUs when the Ray cluster has them, else CPU actors (default %(default)s)")
    p.add_argument(
        "--address", default=None,
        help="Ray cluster to join (default: RAY_ADDRESS, a running local cluster, or a new local one)")
    p.add_argument(
        "--compile", default="auto", choices=("auto", "on", "off"),
        help="rayconv's --compile for every layout (auto: GPU layouts); unless off, the anchors "
        "also time their torch.compile configurations on GPUs (on: on CPU too) and the fastest counts")
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                   help="rayconv's --cuda-graphs for every layout (auto: whole-step CUDA graphs on GPUs)")
    p.add_argument("--all-gpus-visible", action=argparse.BooleanOptionalAction, default=True,
                   help="actors see every GPU of their node (rayconv's default, as torchrun)")
    p.add_argument(
        "--trace", type=int, default=0, metavar="N",
        help="also profile N steps of each layout with torch.profiler and N more with cProfile (the "
        "actors' Python side): trace-<layout>.txt, device_busy")
    p.add_argument(
        "--call-timeout-s", type=float, default=None, metavar="S",
        help="stop a layout when one call to its actors takes longer than S seconds (a warm-up step, "
        "the first of which compiles on GPUs; a timed step; or the in-actor loop of all --steps steps), note "
        "why in its row and go on to the next (default 630 = 2 x rayconv.run's --collective-timeout-s "
        "300 + 30, as rayconv.run)")


def _add_modes(p: argparse.ArgumentParser) -> None:
    """The anchors, the sweeps, the curve and where the results go."""
    p.add_argument(
        "--anchors", action=argparse.BooleanOptionalAction, default=True,
        help="also time the anchors, plain PyTorch on 1 device and torchrun DDP on the layout's devices, "
        "each in its fastest configuration (python -m rayconv.bench.anchor) (default on)")
    p.add_argument(
        "--anchor-timeout", type=float, default=1800, metavar="S",
        help="seconds each anchor run (all its candidate configurations) may take; past it the fastest "
        "candidate timed so far counts (default %(default)g)")
    p.add_argument(
        "--sweep", choices=("batch", "memory"), default=None,
        help="batch: images/s and peak memory over per-device batches 16..--max-batch; memory: double "
        "the batch until it does not fit (default: neither, the layout table)")
    p.add_argument("--min-batch", type=int, default=16,
                   help="first per-device batch of a sweep (default %(default)s)")
    p.add_argument(
        "--max-batch", type=int, default=1024,
        help="largest per-device batch of --sweep batch (default %(default)s; --sweep memory: 65536)")
    p.add_argument("--curve", action="store_true", help="test error vs wall-clock time on digits")
    p.add_argument("--curve-epochs", type=int, default=5,
                   help="epochs of each --curve run (default %(default)s)")
    p.add_argument(
        "--target-accuracy", type=float, default=None, metavar="A",
        help="with --curve: each run also records the time to the first test top-1 accuracy >= A, in "
        "(0, 1] (rayconv.run's --target-accuracy), one row a run in bench.parquet (default: none)")
    p.add_argument("--out", default="benchmarks/latest",
                   help="folder for the results, or a store's URI such as s3://bucket/prefix (default "
                   "%(default)s)")


def parse_args(argv=None) -> argparse.Namespace:
    """The bench's flags; ``global_batch_size`` becomes a list of ints and ``curve_batches`` the curve's
    batches ([None]: rayconv.run's default). Exits 2 with one line for a malformed batch list."""
    p = OneLineParser(prog="python -m rayconv.bench", description=__doc__.split("\n")[0].replace("``", ""))
    _add_workload(p)
    _add_runtime(p)
    _add_modes(p)
    args = p.parse_args(argv)
    given = args.global_batch_size is not None
    try:
        args.global_batch_size = [int(b) for b in str(args.global_batch_size or 256).split(",")]
    except ValueError:
        p.error(
            f"--global-batch-size {args.global_batch_size}: give comma-separated whole numbers, e.g. 256,1024"
        )
    args.curve_batches = args.global_batch_size if given else [None]
    if args.min_batch < 1:
        p.error(f"--min-batch {args.min_batch}: give a per-device batch of at least 1")
    return args


def check(args) -> None:
    """What can be refused before Ray starts: layout names, the call limit, the data settings and folder,
    the output folder (written to; a store's: a probe object written and deleted), as rayconv.run checks
    them. Raises ConfigError (a StorageError among them) or DataError."""
    for name in args.layouts.split(","):
        Layout.parse(name)
    limit = args.call_timeout_s
    if limit is not None and not 0 < limit <= MAX_CALL_TIMEOUT_S:  # (also refuses nan and inf)
        raise ConfigError(f"--call-timeout-s {limit:g}: give a positive number of seconds up to "
                          f"{MAX_CALL_TIMEOUT_S:g} (or leave it out for the default, 630)")
    if args.target_accuracy is not None:
        if not args.curve:
            raise ConfigError(
                "--target-accuracy times training runs: add --curve (the layout table and sweeps "
                "measure throughput only)")
        Config(target_accuracy=args.target_accuracy).validate()  # (in (0, 1], refused as rayconv.run does)
    if args.data != "synthetic":
        make_source(Config(data=args.data, data_dir=args.data_dir, loader_workers=args.loader_workers,
                           data_on_device=args.data_on_device,
                           decode=args.decode, image_size=args.image_size, device=args.device).validate())
    check_writable(args.out, "--out")


def main(argv=None) -> int:
    """Run the bench; returns the exit status (0; 1: no layout measured; 2: bad input or cluster)."""
    args = parse_args(argv)
    try:
        check(args)
        args.out = place(args.out, flag="--out")   # (a Path, or a storage.Location in a store)
        args.out.mkdir(parents=True, exist_ok=True)
        connect(args.address)
        args.device_kind, _ = available_devices(args.device)
        if args.sweep:
            sweep_batch(args, until_largest=args.sweep == "memory")
        elif args.curve:
            training_curve(args)
        elif not any(r.get("images_per_s") for r in main_bench(args)):
            print("rayconv.bench: error: no layout was measured (the note column of "
                  f"{describe(args.out / 'bench.md')} says why)", file=sys.stderr)
            return 1
    except (ConfigError, DataError, ClusterError) as e:
        print(f"rayconv.bench: error: {e}", file=sys.stderr)
        return 2
    print(f"results in {describe(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

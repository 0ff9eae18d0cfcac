"""``python -m rayconv.tune``: a hyperparameter search over rayconv runs (``rayconv.tune``).

    python -m rayconv.tune --space '{"lr": {"loguniform": [0.01, 1]}}' --num-samples 4 --scheduler asha \\
        --max-concurrent 2 --dp 2 --epochs 4
    python -m rayconv.tune --space '{"lr": {"loguniform": [0.01, 1]}}' --num-samples 4 --scheduler pbt \\
        --eval-every 100 --dp 1 --epochs 4
    python -m rayconv.tune --resume runs/search-20250101-120000

The search's own flags are below; every other flag is a ``python -m rayconv.run`` flag, the base
settings of every trial (``--out``: the search folder). A bad space, an unknown flag or a trial the
run would refuse: one line, exit 2, before any trial starts. Exit 0 when the search ended (failed
trials are rows of its results), 1 when no trial finished, 130 on Ctrl-C (Tune stops the trials and
saves the search: no best trial is named, and the line printed says how to continue it with --resume).
"""

from __future__ import annotations

import sys
from typing import Optional

from rayconv.errors import ClusterError, ConfigError, DataError, LayoutError
from rayconv.flags import OneLineParser, read_settings


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m rayconv.tune", error_name="rayconv.tune", add_help=True,
                      description="Search rayconv run flags with Ray Tune; other flags are rayconv.run's "
                                  "(the base settings).")
    p.add_argument("--space", help="JSON object (or a .json/.yaml file) of flag -> {grid|choice: [...]} or "
                                   "{uniform|loguniform|randint: [low, high]}")
    p.add_argument("--num-samples", type=int, default=1,
                   help="samples of the space (each grid crossed in full per sample)")
    p.add_argument("--scheduler", default="asha",
                   help="asha (early stop at evaluations), pbt (population-based "
                        "training; needs --eval-every) or fifo (default asha)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="trials at once (default: as many as fit)")
    p.add_argument("--metric", default=None, help="what trials are ranked by (default val_accuracy with "
                                                  "--val-split, else test_accuracy)")
    p.add_argument("--mode", default=None, help="max or min (default: min for losses and errors, else max)")
    p.add_argument("--grace-period", type=int, default=1,
                   help="asha: evaluations before a trial can be stopped")
    p.add_argument("--reduction-factor", type=int, default=2,
                   help="asha: 1 in this many trials goes on at each rung")
    p.add_argument("--perturbation-interval", type=int, default=2,
                   help="pbt: evaluations between a trial's exploit-and-explore decisions")
    p.add_argument("--synch", action="store_true",
                   help="pbt: the trials wait for each other at each perturbation "
                        "(each is stopped and restarted from its checkpoint there)")
    p.add_argument("--resume", default=None,
                   help="continue an interrupted search from its folder (its own settings)")
    return p


def unknown_flags(rest: list[str], search_parser: OneLineParser) -> None:
    """Raise ConfigError naming the flags of ``rest`` (what the search's parser left) that no
    ``rayconv.run`` flag takes either, with the closest flag of both commands."""
    from rayconv.flags import build_parser, closest_flags

    def names(p) -> set[str]:
        return {o for a in p._actions for o in a.option_strings if o.startswith("--")}

    run = names(build_parser())
    unknown = [w.split("=")[0] for w in rest if w.startswith("--") and w.split("=")[0] not in run]
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)}"
                          + closest_flags(unknown, sorted(run | names(search_parser)))
                          + " (--help lists the search's flags; the others are python -m rayconv.run's)")


def main(argv: Optional[list[str]] = None) -> int:
    from rayconv.run import line_buffered

    line_buffered()
    search_parser = parser()
    args, rest = search_parser.parse_known_args(argv)
    try:
        from rayconv.tune.space import read_space

        unknown_flags(rest, search_parser)

        if args.resume:
            if args.space or rest:
                raise ConfigError("--resume continues a search with its own settings: drop --space and run "
                                  "flags")
            space, base = {}, {}
        else:
            if not args.space:
                raise ConfigError("--space is required: e.g. --space '{\"lr\": {\"loguniform\": [0.01, 1]}}'")
            space, base = read_space(args.space), read_settings(rest)
        from rayconv.tune.runner import search

        found = search(space, base, num_samples=args.num_samples, scheduler=args.scheduler,
                       max_concurrent=args.max_concurrent, metric=args.metric, mode=args.mode,
                       grace_period=args.grace_period, reduction_factor=args.reduction_factor,
                       perturbation_interval=args.perturbation_interval, synch=args.synch, resume=args.resume)
    except (ConfigError, DataError, LayoutError, FileExistsError) as e:
        print(f"rayconv.tune: error: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"rayconv.tune: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # (a second Ctrl-C: Tune's own handler took the first, below)
        from rayconv.signals import quiet_exit
        from rayconv.tune.runner import CURRENT

        quiet_exit()
        where = CURRENT.get("search_dir") or args.resume
        print("rayconv.tune: interrupted" + (f": continue with `python -m rayconv.tune --resume {where}`"
                                             if where else ""), file=sys.stderr)
        return 130
    if found.interrupted:   # (Ctrl-C: Tune stopped the trials and saved the search; the hint is printed)
        return 130
    return 0 if found.best is not None else 1


if __name__ == "__main__":
    sys.exit(main())

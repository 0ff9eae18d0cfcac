"""``python -m rayconv.run``: parse the command line, train, exit 0 on success.

With no arguments it trains the small ConvNet on the embedded digits data, data parallel over every
device of the Ray cluster (a local one is started when none is running). Errors a user can fix are
printed as one line naming what to change, with exit status 2; a failed actor gives exit status 1.
"""

from __future__ import annotations

import sys
from typing import Optional

from rayconv.outputs.checkpoint import latest_checkpoint
from rayconv.errors import ClusterError
from rayconv.config import ConfigError, parse_args
from rayconv.errors import DataError
from rayconv.errors import PlanError


def main(argv: Optional[list[str]] = None) -> int:
    cfg = None
    try:
        cfg = parse_args(argv)
        from rayconv.driver.job import fit  # imports torch/ray: after argument errors are out of the way

        fit(cfg)
        return 0
    except (ConfigError, DataError, PlanError, FileExistsError) as e:
        print(f"rayconv: error: {e}", file=sys.stderr)
        return 2
    except (ClusterError, FloatingPointError) as e:
        print(f"rayconv: error: {e}", file=sys.stderr)
        _resume_hint(cfg)
        return 1
    except KeyboardInterrupt:
        print("rayconv: interrupted: actors stopped", file=sys.stderr)
        _resume_hint(cfg)
        return 130


def _resume_hint(cfg) -> None:
    """After a failure: where the last checkpoint is, and how to continue from it."""
    if cfg is None or not cfg.out:
        return
    ckpt = latest_checkpoint(cfg.out)
    if ckpt is not None:
        print(f"rayconv: last checkpoint {ckpt}: continue with `python -m rayconv.run --resume {cfg.out}`",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m rayconv.run``: parse the command line, train, exit 0 on success.

With no arguments it trains the small ConvNet on the embedded digits data, data parallel over every
device of the Ray cluster (a local one is started when none is running). Errors a user can fix are
printed as one line naming what to change, with exit status 2: bad settings, data and layouts, also
those met mid-run (a file that does not decode, names it; a loss that is not finite, the training
diverged: a lower --lr), and an --elastic run left below its minimum; a failed actor or a cluster
that failed gives exit status 1;
Ctrl-C exit status 130 and SIGTERM 143, the actors stopped and what the run wrote kept.
Settings come, lowest first, from the ``--resume`` checkpoint, the ``--config`` file, the flags.
On a cluster that outlives the command (``ray start --head``, then commands with ``--address`` or
none), a run that ended normally leaves its actors there for ``--keep-actors-s`` seconds, for the
next command that needs the same ones (``cluster.across``).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Optional

from rayconv.config import Config
from rayconv.errors import ClusterError, ConfigError, DataError, LayoutError, TooFewDevices
from rayconv.flags import from_mapping, read_settings, resumed_settings
from rayconv.outputs.checkpoint import latest_checkpoint, saved_config
from rayconv.signals import quiet_exit, stopped_by
from rayconv.startup import begin_command

_IMPORTED = time.monotonic()  # the start-up clock's origin where the process's own start is unknown


def parse_command_line(argv: Optional[list[str]] = None) -> Config:
    """The validated settings of ``argv``: flags over the ``--config`` file over the settings saved in
    the ``--resume`` checkpoint. Raises ConfigError (CheckpointError); argparse exits 2 on a bad flag."""
    values = read_settings(argv)
    if values.get("resume"):
        values = {**resumed_settings(saved_config(values["resume"])), **values}
    return from_mapping(values).validate()


def main(argv: Optional[list[str]] = None) -> int:
    cfg = None
    begin_command(_IMPORTED)  # summary.json's startup: seconds since the command
    line_buffered()
    try:
        cfg = parse_command_line(argv)
        # The driver imports Ray, then torch (seconds), only once the arguments are known to be good;
        # the actors start before torch where they can (driver.early).
        from rayconv.api import start_and_train
        from rayconv.driver.prestart import with_output_folder

        if argv is None:   # the command (not a Python caller's main(argv)): actors may stay on the cluster
            from rayconv.cluster.acquire import keep_across_commands

            keep_across_commands()

        cfg = with_output_folder(cfg)  # named before the run starts, so that a failure's hint can name it
        start_and_train(cfg)
        return 0
    except (ConfigError, DataError, LayoutError, FileExistsError, FloatingPointError) as e:
        print(f"rayconv: error: {e}", file=sys.stderr)
        if isinstance(e, (DataError, FloatingPointError)):   # (met mid-run: the last checkpoint to resume)
            _resume_hint(cfg)
        return 2
    except TooFewDevices as e:   # --elastic below its minimum: one line, the resume command in it
        print(f"rayconv: error: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"rayconv: error: {e}", file=sys.stderr)
        _resume_hint(cfg)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM during the run (rayconv.signals)
        if argv is None:   # (the command: it exits now)
            quiet_exit()
        by = stopped_by()
        print(f"rayconv: interrupted{' by SIGTERM' if by == 'SIGTERM' else ''}: the run and any actors it "
              "started are stopped", file=sys.stderr)
        _resume_hint(cfg)
        return 128 + getattr(signal, by)


def line_buffered() -> None:
    """Each console line written out as it is printed, also into a pipe or a log file (``| tee``,
    ``> log``), where Python would hold them back in blocks: a run that waits for devices says so at once."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)   # (a replaced stream may have none)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def _resume_hint(cfg: Optional[Config]) -> None:
    """After a failure or interruption: where the last checkpoint is, and how to continue from it; or,
    when the run's folder stayed without one, that --checkpoint-every makes the next run resumable."""
    if cfg is None or not cfg.out:
        return
    ckpt = latest_checkpoint(cfg.out)
    if ckpt is not None:
        print(f"rayconv: last checkpoint {ckpt}: continue with `python -m rayconv.run --resume {cfg.out}`",
              file=sys.stderr)
    elif (Path(cfg.out) / "metrics.parquet").is_file():
        print(f"rayconv: {Path(cfg.out).absolute()} keeps the steps' metrics but no checkpoint to resume "
              "from: give --checkpoint-every N (steps) to make a run resumable", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

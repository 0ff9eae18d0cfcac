"""SIGTERM (``ray job stop``, a scheduler, ``kill``) stops a run as Ctrl-C does.

Once Ray is connected, its own handler ends the driver at once on SIGTERM, leaving the run's folder
without a summary. ``sigterm_as_interrupt`` makes SIGTERM raise KeyboardInterrupt instead, so that
the driver stops its actors and keeps what the run wrote; ``stopped_by`` then tells the two apart.
Imports nothing heavy (``rayconv.run`` reads it to choose its exit status).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

_received: list[int] = []  # the signals the handler took, in order


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """For the body, SIGTERM raises KeyboardInterrupt (and is recorded for ``stopped_by``), as SIGINT does;
    a second SIGINT or SIGTERM while the first one's stop is under way (GNU ``timeout`` signals the
    process and then its group; a second Ctrl-C) lets that stop go on. The handlers before it are put
    back afterwards. Only the main thread can take signals: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        if len(_received) == 1:
            raise KeyboardInterrupt

    _received.clear()  # (this run's interruption is its own)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before if before is not None else signal.SIG_DFL)


def quiet_exit() -> None:
    """For the rest of the process (a command that was interrupted and now exits, Ray's own atexit
    shutdown among what is left): a further SIGINT is ignored, not raised as KeyboardInterrupt into
    that shutdown as a traceback. Main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def stopped_by() -> str:
    """Which signal the last interruption came from: "SIGTERM" if the handler took that first, else
    "SIGINT"."""
    return "SIGTERM" if _received[:1] == [signal.SIGTERM] else "SIGINT"

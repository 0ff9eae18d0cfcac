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
    """For the body, SIGTERM raises KeyboardInterrupt (and is recorded for ``stopped_by``); the handler
    before it is put back afterwards. Only the main thread can take signals: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        raise KeyboardInterrupt

    _received.clear()  # (this run's interruption is its own)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def stopped_by() -> str:
    """Which signal the last interruption came from: "SIGTERM" if the handler took one, else "SIGINT"."""
    return "SIGTERM" if _received else "SIGINT"

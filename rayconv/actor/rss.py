"""Peak private memory of a process and its descendants (the loader's forked workers), sampled.

``RssAnon`` (``/proc/PID/status``) counts a process's anonymous resident pages: its heap and the pages
it holds privately, not file pages such as memory-mapped shards in the page cache (those are
``RssFile``, shared by every process that maps them). The kernel keeps a peak of the whole resident set
(``VmHWM``) but not of ``RssAnon``, so a daemon thread samples it every ``interval_s`` seconds (Linux
only; elsewhere the peaks stay None).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional


def rss_anon_kib(pid: int) -> Optional[int]:
    """``RssAnon`` of ``pid`` in KiB, None when the process is gone or the kernel does not report it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (``/proc/PID/task/*/children``), empty where /proc lacks it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(x) for x in task.read_text().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


class RssSampler:
    """Samples ``RssAnon`` of ``pid`` and its descendants on a daemon thread; ``peaks()`` -> MiB."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.pid, self.interval_s = pid, interval_s
        self.own: Optional[int] = None        # peak KiB of pid
        self.children: Optional[int] = None   # peak KiB of any one descendant
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayconv-rss", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        own = rss_anon_kib(self.pid)
        if own is not None:
            self.own = max(self.own or 0, own)
        for kid in descendants(self.pid):
            k = rss_anon_kib(kid)
            if k is not None:
                self.children = max(self.children or 0, k)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def peaks(self) -> dict[str, Any]:
        """``peak_rss_anon_mib`` (this process) and ``loader_peak_rss_anon_mib`` (its largest child; None
        when none was seen), sampled up to now."""
        self.sample()
        mib = lambda k: None if k is None else round(k / 1024, 1)  # noqa: E731
        return {"peak_rss_anon_mib": mib(self.own), "loader_peak_rss_anon_mib": mib(self.children)}

    def stop(self) -> None:
        self._stop.set()

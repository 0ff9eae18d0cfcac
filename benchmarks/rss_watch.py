"""Private memory (RssAnon) of every rayconv actor and loader process a command starts, while it runs:
its peak and its course, for benchmarks/shards_scale.sh and raw_shards.sh:

    python benchmarks/rss_watch.py OUT.json -- python -m rayconv.bench ...

runs the command, samples every 0.5 s each of its descendants whose command line Ray titled
``ray::Actor...`` or ``ray::rayconv...`` (the actors of the Ray cluster the command starts; their forked
loader workers carry the same title; other clusters' actors on this machine are not counted) or that runs
a raw shard source's reader process (``python -m rayconv.data.raw_reader``), and writes
``{"actors": {pid: peak MiB}, "max_mib": ..., "samples": {pid: [[t, MiB], ...]}, "end_s": t}`` (the peak
of each process sampled and every sample, t in seconds since the command started, ``end_s`` when it
ended; RssAnon from /proc/PID/status, as ``rayconv/actor/rss.py`` reads it). Exits with the command's
status.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rayconv.actor.rss import descendants, rss_anon_kib  # noqa: E402


def _actors(root: int) -> list[tuple[int, str]]:
    """(pid, title) of the actors and loader processes among ``root``'s descendants."""
    found = []
    for pid in descendants(root):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        title = args[0].decode(errors="replace")
        if title.startswith(("ray::Actor", "ray::rayconv")):
            found.append((pid, title))
        elif b"rayconv.data.raw_reader" in args[:3]:
            found.append((pid, "rayconv.data.raw_reader"))
    return found


def main(argv: list[str]) -> int:
    out, cmd = Path(argv[0]), argv[argv.index("--") + 1:]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    peaks: dict[int, float] = {}
    titles: dict[int, str] = {}
    samples: dict[int, list[list[float]]] = {}
    while proc.poll() is None:
        for pid, title in _actors(proc.pid):
            kib = rss_anon_kib(pid)
            if kib is not None:
                peaks[pid] = max(peaks.get(pid, 0.0), kib / 1024)
                titles[pid] = title
                samples.setdefault(pid, []).append([round(time.monotonic() - t0, 2), round(kib / 1024, 1)])
        time.sleep(0.5)
    out.write_text(json.dumps({"actors": {str(p): round(v, 1) for p, v in sorted(peaks.items())},
                               "titles": {str(p): titles[p] for p in sorted(peaks)},
                               "max_mib": round(max(peaks.values()), 1) if peaks else None,
                               "end_s": round(time.monotonic() - t0, 2),
                               "samples": {str(p): samples[p] for p in sorted(samples)}}) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

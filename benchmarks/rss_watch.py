"""Peak private memory (RssAnon) of every rayconv actor and loader process on this machine while a
command runs, for benchmarks/shards_scale.sh:

    python benchmarks/rss_watch.py OUT.json -- python -m rayconv.bench ...

runs the command, samples every 0.5 s each process whose command line Ray titled ``ray::Actor...`` or
``ray::rayconv...`` (the actors; their forked loader workers carry the same title), and writes
``{"actors": {pid: peak MiB}, "max_mib": ...}`` (the peak of each process sampled, RssAnon from
/proc/PID/status, as ``rayconv/actor/rss.py`` reads it). Exits with the command's status.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rayconv.actor.rss import rss_anon_kib  # noqa: E402


def _actors() -> list[tuple[int, str]]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(("ray::Actor", "ray::rayconv")):
            found.append((int(d.name), title))
    return found


def main(argv: list[str]) -> int:
    out, cmd = Path(argv[0]), argv[argv.index("--") + 1:]
    proc = subprocess.Popen(cmd)
    peaks: dict[int, float] = {}
    titles: dict[int, str] = {}
    while proc.poll() is None:
        for pid, title in _actors():
            kib = rss_anon_kib(pid)
            if kib is not None:
                peaks[pid] = max(peaks.get(pid, 0.0), kib / 1024)
                titles[pid] = title
        time.sleep(0.5)
    out.write_text(json.dumps({"actors": {str(p): round(v, 1) for p, v in sorted(peaks.items())},
                               "titles": {str(p): titles[p] for p in sorted(peaks)},
                               "max_mib": round(max(peaks.values()), 1) if peaks else None}, indent=1) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

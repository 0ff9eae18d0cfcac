"""A search's results table: one row per trial (its sampled settings, the metric, the test accuracy,
how it ended, its folder), printed, and written as ``results.csv`` and ``results.json`` into the search
folder; and the best trial. Reads Tune's ``ResultGrid`` and each trial folder's ``summary.json``.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any, Optional

from rayconv.files import atomic_write, write_json


def status_of(summary: Optional[dict[str, Any]], error: Optional[BaseException],
              state: Optional[str] = None) -> str:
    """How a trial ended, in a few words: finished, stopped early (the scheduler ended it after an
    evaluation), interrupted (the search was: Tune's ``state`` of the trial at the search's end is not
    TERMINATED), failed: its one-line error, or not run."""
    if error is not None:
        return f"failed: {error_line(error)}"
    if summary is None:
        return "not run"
    if summary.get("status") == "finished":
        return "finished"
    if state is not None and state not in ("TERMINATED", "ERROR"):
        return f"interrupted at step {summary.get('steps_done')}"
    if summary.get("stopped_by"):
        return f"stopped early at step {summary.get('steps_done')}"
    return str(summary.get("status", "unknown"))


def error_line(error: BaseException) -> str:
    """The trial's own one-line error out of Tune's and Ray's wrapping."""
    text = str(error)
    found = re.findall(r"TrialFailed: (.+)", text)
    if found:
        return found[-1].strip()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(error).__name__


def trial_number(path: Optional[str]) -> Optional[int]:
    """The trial's number from its Tune folder's name (``Trial_3f2a1_00002_2_lr=...``)."""
    m = re.search(r"_[0-9a-f]{5}_(\d{5})(?:_|$)", Path(path or "").name)
    return int(m.group(1)) if m else None


def collect(grid, search_dir: Path, names: list[str], metric: str,
            states: Optional[dict[int, str]] = None) -> list[dict[str, Any]]:
    """The table's rows from a Tune ``ResultGrid``, in trial order (``states``: Tune's status of each
    trial number at the search's end, where known)."""
    rows = []
    for result in grid:
        k = trial_number(result.path)
        folder = search_dir / f"trial-{k}"
        summary_path = folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        metrics = result.metrics or {}
        config = result.config or {}
        params = Path(result.path or "") / "params.json"
        if not config and params.is_file():   # (a restored trial that reported nothing)
            config = json.loads(params.read_text())
        value = metrics.get(metric)
        if value is None and summary and summary.get("status") == "finished":
            value = summary.get(metric)
        rows.append({"trial": f"trial-{k}", **{n: config.get(n) for n in names}, metric: value,
                     "test_accuracy": (summary or {}).get("test_accuracy", metrics.get("test_accuracy")),
                     "status": status_of(summary, result.error, (states or {}).get(k)),
                     "folder": str(folder) if folder.exists() else ""})
    return sorted(rows,
                  key=lambda r: int(r["trial"].split("-")[1]) if r["trial"].split("-")[1].isdigit() else 0)


def best(rows: list[dict[str, Any]], metric: str, mode: str) -> Optional[dict[str, Any]]:
    """The row with the best ``metric`` (``mode`` max or min) among trials that have it."""
    scored = [r for r in rows if isinstance(r.get(metric), (int, float))]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda r: r[metric])


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text columns."""
    if not rows:
        return "(no trials)"
    keys = list(rows[0])
    cells = [[cell_text(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(keys), *(line(c) for c in cells)])


def cell_text(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write(search_dir: Path, rows: list[dict[str, Any]], best_row: Optional[dict[str, Any]],
          metric: str) -> None:
    """``results.csv`` (one line per trial) and ``results.json`` (the rows, the metric, the best trial),
    each written whole (``files.atomic_write``)."""
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    atomic_write(search_dir / "results.csv", lambda tmp: Path(tmp).write_text(buf.getvalue()))
    write_json(search_dir / "results.json", {"metric": metric, "best": best_row, "trials": rows})

"""Charts of the bench and the report (matplotlib, optional: without it no chart is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from rayconv.files import atomic_write


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None without matplotlib (charts skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def error_against_time(rows: Sequence[dict[str, Any]], key: str, title: str, path: Path) -> None:
    """Test error (log scale) against wall-clock time (s), one line per distinct ``row[key]``, in the
    rows' order (the paper's Figure 1): each row has ``time_s`` and ``test_error``. Writes ``path``
    (PNG, whole or absent: a Path, or a ``storage.Location`` in a store); does nothing without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r[key] for r in rows):
        pts = [r for r in rows if r[key] == label]
        ax.plot([p["time_s"] for p in pts], [p["test_error"] for p in pts], marker="o", ms=3, label=label)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("test error")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)

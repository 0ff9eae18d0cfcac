"""``--keep-best``: the weights of the evaluation with the best validation accuracy, kept in
``<out>/best/``: ``model.pt`` (a plain state_dict, as the run's own ``model.pt``) and ``best.json``
(``step``: the step after which it was evaluated; ``val_accuracy``).

Written at each evaluation whose validation top-1 exceeds every earlier one (ties keep the earlier):
both files into ``best.tmp/``, then the folders swapped by renames (``best`` -> ``best.old``,
``best.tmp`` -> ``best``), so ``best/`` always holds a model.pt and the best.json that describes it; a
run continued in the same folder (``--resume``, a recovery) starts from the best recorded there.
In an object store (no rename) both files go to ``best.tmp/``, then ``best/best.json`` is deleted
before ``best/``'s files are replaced by server-side copies, best.json last: a ``best/`` with its
best.json always describes its model.pt, and while it has none, ``best.tmp/`` holds both.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from rayconv.files import write_json
from rayconv.storage import Location, Place


@dataclass
class Best:
    """The best validation accuracy so far and the step after which it was evaluated (None: none yet)."""

    step: Optional[int] = None
    val_accuracy: Optional[float] = None

    def improves(self, val_accuracy: Optional[float]) -> bool:
        return val_accuracy is not None and (self.val_accuracy is None or val_accuracy > self.val_accuracy)

    def summary(self) -> dict[str, Any]:
        """summary.json's ``best_step`` and ``best_val_accuracy`` (null without --keep-best or before one)."""
        return {"best_step": self.step, "best_val_accuracy": self.val_accuracy}


def load_best(out: Place) -> Best:
    """The best recorded in ``out`` (``best/``, or ``best.old/`` / ``best.tmp/`` when a swap was cut
    short), else none."""
    for folder in ("best", "best.old", "best.tmp") if isinstance(out, Location) else ("best", "best.old"):
        meta = (out if isinstance(out, Location) else Path(out)) / folder / "best.json"
        if meta.is_file() and (meta.parent / "model.pt").is_file():
            d = json.loads(meta.read_text())
            return Best(int(d["step"]), float(d["val_accuracy"]))
    return Best()


def write_best(out: Place, step: int, val_accuracy: float, write_model: Callable[[Place], None]) -> Place:
    """``out/best/`` <- ``write_model(path)``'s model.pt and best.json, swapped in by renames (in a
    store: by copies; module docstring); returns the folder."""
    if isinstance(out, Location):
        return _write_best_in_store(out, step, val_accuracy, write_model)
    out = Path(out)
    final, tmp, old = out / "best", out / "best.tmp", out / "best.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_model(tmp / "model.pt")
    write_json(tmp / "best.json", {"step": step, "val_accuracy": val_accuracy})
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _write_best_in_store(out: Location, step: int, val_accuracy: float,
                         write_model: Callable[[Place], None]) -> Location:
    final, tmp = out / "best", out / "best.tmp"
    write_model(tmp / "model.pt")
    write_json(tmp / "best.json", {"step": step, "val_accuracy": val_accuracy})
    (final / "best.json").unlink(missing_ok=True)
    for name in ("model.pt", "best.json"):   # (server-side copies: no bytes through this process)
        out.fs.copy_file((tmp / name).path, (final / name).path)
    tmp.delete()
    return final

"""TensorBoard event files of a run (``--tensorboard on``): ``<out>/tensorboard/events.out.tfevents.*``,
written by ``torch.utils.tensorboard.SummaryWriter`` from the driver's metrics rows
(``outputs.metrics``) each time ``metrics.parquet`` is written, so nothing more leaves the actors.

Scalars, by step: ``train/loss``, ``train/lr``, ``train/images_per_s``, ``train/input_stall_ms``,
``train/loss_scale`` (fp16 only), and per evaluation ``val/accuracy``, ``val/loss``,
``val/top5_accuracy`` (with ``--val-split``), ``test/accuracy``, ``test/loss``, ``test/top5_accuracy``,
``test/ema_accuracy`` (with ``--model-ema``), each where the row has it. ``add_images`` (``--log-images
N``): one grid (``torchvision.utils.make_grid``) of augmented training images at step 0. Read them with
``tensorboard --logdir runs/``.

The ``tensorboard`` package is imported when the first file is written; without it (or when its
import fails: a protobuf or numpy it does not support) the run goes on without event files after one
console note. A run continued in a folder that already has event files
(``--resume``) writes with ``purge_step`` at its first step, so TensorBoard hides what the earlier
process wrote from there on; rows already written by this process are not written again.

With ``--out`` in an object store (a ``storage.Location``) the writer writes into a local temporary
folder and each event file is uploaded whole after every flush (each upload replaces the object: a
reader sees the file as of the last flush) and at ``close``.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

TAGS = {  # row field -> tag, per row kind
    "train": {"loss": "train/loss", "lr": "train/lr", "images_per_s": "train/images_per_s",
              "input_stall_ms": "train/input_stall_ms", "loss_scale": "train/loss_scale"},
    "eval": {"val_accuracy": "val/accuracy", "val_loss": "val/loss", "val_top5_accuracy": "val/top5_accuracy",
             "test_accuracy": "test/accuracy", "test_loss": "test/loss",
             "test_top5_accuracy": "test/top5_accuracy", "ema_test_accuracy": "test/ema_accuracy"},
}


def import_writers(tensorboard: bool) -> None:
    """Import pyarrow's Parquet writer and (``tensorboard``) TensorBoard's in a background thread: the
    first write of metrics.parquet and its event files would otherwise import them (seconds) while
    steps wait. An import that fails is reported by the write that needs it."""
    def _imports() -> None:
        try:
            import pyarrow.parquet  # noqa: F401
            if tensorboard:
                import torch.utils.tensorboard  # noqa: F401
        except Exception:  # noqa: BLE001 - the write reports it (EventFiles._open)
            pass

    threading.Thread(target=_imports, name="rayconv-imports", daemon=True).start()


class EventFiles:
    """The event files of one run folder ``out`` (see the module docstring); ``start``: the first step
    this process trains (its checkpoint's, on resume). ``enabled`` False writes nothing."""

    def __init__(self, out: Any, start: int = 0, enabled: bool = True, log: Callable[[str], None] = print):
        from rayconv.storage import Location
        self.remote = out / "tensorboard" if isinstance(out, Location) else None   # (uploaded to)
        # (for a store: a local folder made at the first write, so that a run stopped before it leaves none)
        self.folder: Optional[Path] = None if self.remote is not None else Path(out) / "tensorboard"
        self.start, self.enabled, self.log = start, enabled, log
        self.writer: Any = None
        self.written: dict[str, int] = {}   # row kind -> last step written

    def _open(self) -> Any:
        if self.writer is None and self.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter  # (needs the tensorboard package)
            # absent, or broken (its protobuf or numpy): the run goes on
            except Exception as e:  # noqa: BLE001
                self.enabled = False
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self.log(f"rayconv: no TensorBoard event files ({why}): pip install tensorboard, or pass "
                         "--tensorboard off")
                return None
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="rayconv-tensorboard-"))
            names = self.remote.listdir() if self.remote is not None else \
                [p.name for p in self.folder.glob("*")] if self.folder.is_dir() else []
            resumed = any(n.startswith("events.out.tfevents.") for n in names)
            if resumed:   # (the earlier process's events from `start` on are hidden)
                self.written = {k: max(self.written.get(k, -1), self.start - 1) for k in TAGS}
            self.writer = SummaryWriter(str(self.folder), purge_step=self.start if resumed else None)
        return self.writer

    def add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Write the rows not written yet (by kind and step), then flush."""
        writer = self._open()
        if writer is None:
            return
        for row in rows:
            tags = TAGS.get(row["kind"])
            if tags is None or row["step"] <= self.written.get(row["kind"], -1):
                continue
            for name, tag in tags.items():
                if row.get(name) is not None:
                    writer.add_scalar(tag, float(row[name]), int(row["step"]))
            self.written[row["kind"]] = int(row["step"])
        writer.flush()
        self._upload()

    def _upload(self) -> None:
        """--out in a store: each local event file -> one object of the same name (whole)."""
        if self.remote is not None and self.folder is not None:
            for f in sorted(self.folder.glob("events.out.tfevents.*")):
                (self.remote / f.name).upload(f)

    def add_image_grid(self, images: Any, step: int = 0) -> None:
        """One grid of ``images`` (N, C, H, W) float, each scaled to [0, 1] by its own range, as
        ``train/images``."""
        writer = self._open()
        if writer is None:
            return
        from torchvision.utils import make_grid   # (torchvision's import takes seconds: only when used)

        grid = make_grid(images.float().cpu(), nrow=max(1, int(len(images) ** 0.5)), normalize=True,
                         scale_each=True)
        writer.add_image("train/images", grid, step)
        writer.flush()
        self._upload()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self._upload()
        if self.remote is not None and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def first_images(source: Any, batch: Any, n: int) -> Optional[Any]:
    """The first ``n`` images of training batch ``batch`` (sample indices of epoch 0), augmented as the
    actors see them (a source's augmentation depends on (seed, epoch, index) alone), on the CPU; None
    for data held on the device (its first read decodes the whole data set in this process) and for a
    set in object storage (``ManifestSource``: the driver fetches none of its shards)."""
    import torch

    from rayconv.data.manifest_source import ManifestSource
    from rayconv.data.small import is_held

    if is_held(source) or isinstance(source, ManifestSource):
        return None
    return source.images("train", batch[:n], torch.device("cpu"), 0)

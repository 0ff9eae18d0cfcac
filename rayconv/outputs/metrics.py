"""Step metrics: the actors' numbers reduced to one row per step, the rows written to Parquet, and the
gauges of Ray's dashboard.

One row per step (``kind="train"``): step, epoch, loss (mean over the global batch), lr, step_ms
(the step's own time, the slowest actor's, measured in the actors: ``actor/steptime.py``), images_per_s
(global batch / step_ms), input_stall_ms (the step's wait for input not overlapped with compute, the
largest over the actors that read input) and input_stall_fraction (input_stall_ms / step_ms). One row
per evaluation (``kind="eval"``): test_loss, test_error, test_accuracy and test_top5_accuracy (null
below 5 classes) over every held-out sample once, and with ``--model-ema`` ema_test_accuracy (the
moving average's top-1); with ``--val-split`` val_loss, val_accuracy and val_top5_accuracy over the
validation images (the test columns then null except at the last evaluation, or with ``--eval-test``).
``loss_scale``: the fp16 dynamic loss scale the step ran with (null otherwise).
``layout``: the name of the layout the row ran on (``Layout.name``; it changes in an --elastic run).
``time_s`` is seconds since training began (for test error against wall-clock time).
``metrics.parquet`` is written atomically (temporary file, then rename): a crash never leaves half a file.
Between steps the step loop writes it in a background thread (``MetricsLog.write_soon``), so that the
next steps run while it is written; the final write waits for that one and writes in the caller.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from rayconv.files import atomic_write

# metrics.parquet's columns: kind and layout are strings, step/epoch int64, the rest float64. (pyarrow is
# imported when a file is written or read: every actor imports this module for its gauges.)
COLUMNS = ("kind", "step", "epoch", "loss", "lr", "images_per_s", "step_ms", "time_s", "test_loss",
           "test_error", "test_accuracy", "input_stall_ms", "input_stall_fraction", "test_top5_accuracy",
           "ema_test_accuracy", "loss_scale", "val_loss", "val_accuracy", "val_top5_accuracy", "layout")


@functools.cache
def schema():
    """metrics.parquet's ``pyarrow.Schema`` (``COLUMNS``)."""
    import pyarrow as pa

    kinds = {"kind": pa.string(), "step": pa.int64(), "epoch": pa.int64(), "layout": pa.string()}
    return pa.schema([(name, kinds.get(name, pa.float64())) for name in COLUMNS])


def __getattr__(name: str):
    if name == "SCHEMA":  # (the schema as a module attribute, built on first use)
        return schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reduce_step(results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Global loss (mean per sample) and sample count from the actors' step results; the step's own
    time and input stall (ms), the largest over the actors (None where the actors did not time it);
    the fp16 loss scale (one value, agreed over the mesh; None without one)."""
    results = list(results)
    rep = [r for r in results if r["reports"]]
    samples = sum(r["samples"] for r in rep)
    loss_sum = sum(r["loss_sum"] for r in rep)
    own = [r["step_ms"] for r in results if r.get("step_ms") is not None]
    stall = [r["input_stall_ms"] for r in results if r.get("input_stall_ms") is not None]
    scale = [r["loss_scale"] for r in results if r.get("loss_scale") is not None]
    return {"loss": loss_sum / max(1, samples), "samples": samples,
            "correct": sum(r["correct"] for r in rep), "step_ms": max(own) if own else None,
            "input_stall_ms": max(stall) if stall else None, "loss_scale": float(scale[0]) if scale else None}


class MetricsLog:
    """Rows of the run, kept in memory and flushed to ``metrics.parquet``; ``on_write(rows)``, if set,
    is called after each write with the rows written (the TensorBoard event files,
    ``outputs.tensorboard``)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.on_write: Optional[Callable[[list[dict[str, Any]]], None]] = None
        self._wanted: Optional[tuple[Path, int]] = None   # the background thread's next write: (path, rows)
        self._writer: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._done = threading.Condition()

    def add(self, **row: Any) -> None:
        self.rows.append({name: row.get(name) for name in COLUMNS})

    def table(self, n: Optional[int] = None):
        """The first ``n`` rows (all: None) as a ``pyarrow.Table`` of ``schema()``."""
        import pyarrow as pa

        return pa.Table.from_pylist(self.rows[:n], schema=schema())

    def write(self, path: Path) -> None:
        """Write every row now (after the background write in progress, if any). Raises OSError, or what
        the background write raised."""
        self.wait()
        self._write(path, len(self.rows))

    def write_soon(self, path: Path) -> None:
        """Write the rows there are now in a background thread: rows are only appended, so the thread
        reads a fixed prefix. A request made while one is waiting replaces it. Raises what the previous
        background write raised."""
        with self._done:
            self._raise()
            self._wanted = (path, len(self.rows))
            if self._writer is None:
                self._writer = threading.Thread(target=self._background, name="rayconv-metrics", daemon=True)
                self._writer.start()

    def wait(self) -> None:
        """Until no background write is waiting or running. Raises what it raised."""
        with self._done:
            self._done.wait_for(lambda: self._writer is None)
            self._raise()

    def _background(self) -> None:
        while True:
            with self._done:
                wanted, self._wanted = self._wanted, None
                if wanted is None or self._error is not None:
                    self._writer = None
                    self._done.notify_all()
                    return
            try:
                self._write(*wanted)
            except BaseException as e:  # noqa: BLE001 - raised in the step loop's thread by the next write
                with self._done:
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def _write(self, path: Path, n: int) -> None:
        import pyarrow.parquet as pq

        atomic_write(path, lambda tmp: pq.write_table(self.table(n), tmp))
        if self.on_write is not None:
            self.on_write(self.rows[:n])

    def to_bytes(self, before: Optional[int] = None) -> bytes:
        """The rows (those of steps below ``before`` where given) as a Parquet file's bytes (stored in
        checkpoints)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self.rows if before is None else [r for r in self.rows if r["step"] < before]
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows, schema=schema()), sink)
        return sink.getvalue().to_pybytes()

    def last(self, kind: str, key: str) -> Optional[float]:
        for r in reversed(self.rows):
            if r["kind"] == kind and r[key] is not None:
                return r[key]
        return None


def read_rows(parquet: bytes) -> list[dict[str, Any]]:
    """Rows of a Parquet file's bytes written by ``MetricsLog.to_bytes``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(parquet)).to_pylist()


# ---------------------------------------------------------------------- Ray metrics (dashboard)
# Gauges exported through Ray's metrics agent (Prometheus names ray_rayconv_*), shown in the Ray
# dashboard's Metrics view and Grafana when configured. Tags: run (the run's name on the cluster: its
# output folder's name and a random suffix) and role (an actor's mesh role such as dp1.pp0.fs0, or
# "driver" for the per-run numbers).
GAUGES = {
    "images_per_s": (
        "images per second (actor: its samples / the time between its step calls; driver: images over the "
        "wall-clock of the last 20 steps)"
    ),
    "step_ms": (
        "milliseconds per step (actor: time between its step calls; driver: the step's own time, the slowest "
        "actor's)"
    ),
    "loss": "training loss of the last step (driver: mean over the global batch; actor: over its replica)",
    "peak_memory_gib": "peak device memory allocated, GiB (CUDA actors only)",
    "step": "last finished step",
}
_gauges: dict[str, Any] = {}


def _gauge(name: str):
    if name not in _gauges:
        from ray.util.metrics import Gauge  # (Ray's import takes seconds: only once a gauge is set)

        _gauges[name] = Gauge(f"rayconv_{name}", description=GAUGES[name], tag_keys=("run", "role"))
    return _gauges[name]


def actor_gauges(run: str, role: str, **values: Optional[float]) -> None:
    """Set the gauges named in ``values`` (None skipped) for ``run`` and ``role``; never raises
    (metrics must not stop training)."""
    try:
        for name, v in values.items():
            if v is not None:
                _gauge(name).set(float(v), tags={"run": run, "role": role})
    except Exception:  # noqa: BLE001 - e.g. no metrics agent on this node
        pass

"""The bench's rows as files: ``bench.parquet`` (every column of ``BENCH_SCHEMA``), ``bench.md`` (the
Markdown table of the main columns) and ``speedup.png`` (bars of speedup over 1 device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rayconv.files import atomic_write
from rayconv.outputs.charts import pyplot
from rayconv.storage import Place

# bench.parquet's columns. Every row has all of them: a layout that failed keeps its row, with nulls
# where nothing was measured and ``note`` saying why. (Inferred from the rows instead, the columns
# would be the first row's keys only, and a failed first layout would drop every measured column.)
_F, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()
BENCH_SCHEMA = pa.schema([
    ("model", _S), ("layout", _S), ("global_batch_size", _I), ("image_size", _I), ("note", _S),
    ("images_per_s", _F), ("step_ms", _F),
    # the median timed step (the mean, step_ms, also counts the rare slow ones: epoch ends)
    ("step_ms_median", _F),
    # JSON: each timed step's time (ms) as the driver's loop saw it (its collect after the last)
    ("timed_step_ms", _S),
    ("warmup_s", _F),
    # untimed steps before the timed ones: --warmup, or the first epoch when it ends in a partial batch
    ("warmup_steps", _I),
    ("first_step_s", _F),
    # from the layout's start (its checks, actors starting, their setup) to step 0 done
    ("to_first_step_s", _F),
    ("compiled", _B),
    ("cuda_graphs", _B), ("peak_gib_max", _F), ("peak_gib_per_actor", _S), ("params_per_actor", _S),
    ("compute_ms", _F), ("recv_wait_ms", _F), ("allreduce_wait_ms", _F), ("exchange_exposed_ms", _F),
    ("driver_idle_ms", _F),
    ("comm_mb_per_step", _F), ("comm_mb_per_step_total", _F),
    ("in_actor_step_ms", _F), ("driver_overhead", _F), ("device_busy", _F), ("bubble_fraction", _F),
    ("input_stall_ms", _F), ("input_stall_fraction", _F), ("data", _S),
    ("num_microbatches", _I), ("schedule", _S), ("virtual_stages", _I), ("exchange_chunks", _I),
    ("world_size", _I),
    ("speedup_vs_1", _F), ("plain_pytorch_images_per_s", _F), ("plain_pytorch_config", _S),
    ("plain_pytorch_candidates", _S), ("vs_plain_pytorch", _F), ("torchrun_ddp_images_per_s", _F),
    ("torchrun_ddp_config", _S), ("torchrun_ddp_candidates", _S), ("vs_torchrun_ddp", _F),
    # --curve --target-accuracy A: the run's test accuracy, and the time to A (driver.target; null when
    # not reached), with the first two steps' wall time (compilation, CUDA-graph capture) apart.
    ("test_accuracy", _F), ("target_accuracy", _F), ("time_to_target_s", _F), ("time_to_target_train_s", _F),
    ("first_steps_s", _F),
])

# bench.md's columns
MD_COLUMNS = ["model", "layout", "global_batch_size", "images_per_s", "to_first_step_s", "step_ms",
              "speedup_vs_1", "vs_plain_pytorch", "vs_torchrun_ddp", "peak_gib_max", "compute_ms",
              "recv_wait_ms", "allreduce_wait_ms", "exchange_exposed_ms", "comm_mb_per_step",
              "driver_idle_ms", "in_actor_step_ms", "driver_overhead", "device_busy", "bubble_fraction",
              "input_stall_ms", "input_stall_fraction", "note"]


def bench_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as a table of ``BENCH_SCHEMA`` (missing values null). Raises ValueError for a key the
    schema lacks (it would be dropped silently)."""
    unknown = sorted({k for r in rows for k in r} - set(BENCH_SCHEMA.names))
    if unknown:
        raise ValueError(f"bench rows have columns missing from BENCH_SCHEMA: {unknown}")
    return pa.Table.from_pylist(rows, schema=BENCH_SCHEMA)


def write_table(rows: list[dict[str, Any]], out: Place) -> None:
    """Write ``bench.parquet``, ``bench.md`` and (with matplotlib) ``speedup.png`` into ``out`` (a
    folder, or a ``storage.Location`` in a store), each whole or absent. Raises ValueError as
    ``bench_table``."""
    table = bench_table(rows)
    atomic_write(out / "bench.parquet", lambda tmp: pq.write_table(table, tmp))
    lines = ["| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in MD_COLUMNS) + " |" for r in rows]
    atomic_write(out / "bench.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    speedup_chart(rows, out / "speedup.png")


def _cell(v: Any) -> str:
    if v is None:
        return "not measured"
    return f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else (
        f"{v:.0f}" if isinstance(v, float) else str(v))


def speedup_chart(rows: list[dict[str, Any]], path: Place) -> None:
    """Bars of each row's speedup over rayconv on 1 device; without such rows, no chart (an older
    run's is removed). Nothing without matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if r.get("speedup_vs_1") is not None]
    if not rows:
        path.unlink(missing_ok=True)  # not an older run's chart beside this table
        return
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.7), 4))
    labels = [f"{r['model']}\n{r['layout']}\nB={r['global_batch_size']}" for r in rows]
    ax.bar(range(len(rows)), [r["speedup_vs_1"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speedup over rayconv on 1 device")
    size = rows[0].get("image_size", 224)
    ax.set_title(f"rayconv speedups (same run, synthetic {size}x{size})")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


__all__ = ["BENCH_SCHEMA", "MD_COLUMNS", "bench_table", "write_table", "speedup_chart"]

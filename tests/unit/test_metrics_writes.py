"""metrics.parquet written between steps in a background thread (``MetricsLog.write_soon``): each write
holds the rows there were when it was asked for, a request waiting is replaced by a newer one, the final
``write`` waits for it, and a failed background write is raised in the caller's thread."""

from __future__ import annotations

import threading

import pyarrow.parquet as pq
import pytest

from rayconv.outputs.metrics import MetricsLog


def add(log, n):
    for _ in range(n):
        log.add(kind="train", step=len(log.rows), epoch=0, loss=1.0, lr=0.1)


def test_background_writes_hold_the_rows_asked_for_and_the_newest_request_wins(tmp_path):
    path = tmp_path / "metrics.parquet"
    log, entered, release, written = MetricsLog(), threading.Event(), threading.Event(), []
    log.on_write = lambda rows: (written.append(len(rows)), entered.set(), release.wait(10))
    add(log, 3)
    log.write_soon(path)                 # written while the rows below are added
    assert entered.wait(10)
    add(log, 2)
    log.write_soon(path)                 # waits behind the first ...
    add(log, 4)
    log.write_soon(path)                 # ... and is replaced by this one
    add(log, 1)
    release.set()
    log.wait()
    assert written == [3, 9]
    assert pq.read_table(path).column("step").to_pylist() == list(range(9))
    log.on_write = None
    log.write(path)                      # the final write: every row, in the caller's thread
    assert pq.read_table(path).num_rows == 10


def test_a_failed_background_write_is_raised_by_the_next_call(tmp_path):
    log = MetricsLog()
    add(log, 2)
    log.write_soon(tmp_path / "gone" / "metrics.parquet")
    with pytest.raises(OSError):
        log.wait()
    log.write(tmp_path / "metrics.parquet")   # raised once; the log still writes
    assert pq.read_table(tmp_path / "metrics.parquet").num_rows == 2

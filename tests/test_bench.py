"""The benchmark's plumbing on CPU actors: layouts measured, anchors run, files written (no timing asserted)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rayconv import bench
from rayconv.config import ConfigError


def test_parse_layout():
    assert bench.parse_layout("1gpu") == {"dp": 1}
    assert bench.parse_layout("dp2xfs2") == {"dp": 2, "fs": 2}
    assert bench.parse_layout("pp2m4") == {"dp": 1, "pp": 2, "num_microbatches": 4}
    assert bench.parse_layout("pp2m4v2") == {"dp": 1, "pp": 2, "num_microbatches": 4, "virtual_stages": 2}
    assert bench.parse_layout("plan4") == {"dp": 4, "plan": "krizhevsky2014"}
    assert bench.layout_size("dp2xpp2") == 4
    with pytest.raises(ConfigError, match="unknown layout"):
        bench.parse_layout("tp2")


def test_bench_writes_table_chart_and_anchor_ratios(ray_cluster, tmp_path):
    out = tmp_path / "bench"
    rc = bench.main(["--models", "convnet", "--layouts", "1gpu,dp2,pp2", "--image-size", "32",
                     "--global-batch-size", "32", "--steps", "2", "--warmup", "1", "--device", "cpu",
                     "--out", str(out)])
    assert rc == 0
    rows = pq.read_table(out / "bench.parquet").to_pylist()
    assert [r["layout"] for r in rows] == ["1gpu", "dp2", "pp2"]
    for r in rows:
        assert r["images_per_s"] > 0 and r["step_ms"] > 0
        assert r["vs_plain_pytorch"] is not None and r["vs_plain_pytorch"] > 0
    assert rows[0]["speedup_vs_1"] == pytest.approx(1.0)
    assert rows[1]["vs_torchrun_ddp"] is not None  # the DDP anchor ran under torchrun with gloo
    assert rows[2]["num_microbatches"] in (2, 4, 8) and rows[2]["bubble_fraction"] > 0
    assert rows[1]["allreduce_wait_ms"] is not None and rows[2]["recv_wait_ms"] is not None
    for r in rows:  # the same steps looped inside the actors, against the driver's loop
        assert r["in_actor_step_ms"] > 0 and r["driver_overhead"] == pytest.approx(1 - r["in_actor_step_ms"] / r["step_ms"])
    assert (out / "bench.md").read_text().count("\n") == 2 + len(rows)
    assert (out / "speedup.png").stat().st_size > 1000


def test_bench_sweep_stops_at_max(ray_cluster, tmp_path):
    out = tmp_path / "sweep"
    rc = bench.main(["--models", "convnet", "--layouts", "1gpu", "--image-size", "32", "--sweep", "batch",
                     "--max-batch", "32", "--steps", "2", "--device", "cpu", "--no-anchors", "--out", str(out)])
    assert rc == 0
    rows = pq.read_table(out / "sweep_batch.parquet").to_pylist()
    assert [r["batch_per_device"] for r in rows] == [16, 32] and all(r["fits"] for r in rows)


def test_training_curve_writes_error_against_time(ray_cluster, tmp_path, capsys):
    out = tmp_path / "curve"
    rc = bench.main(["--curve", "--curve-epochs", "1", "--layouts", "1gpu,dp2", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    rows = pq.read_table(out / "curve.parquet").to_pylist()
    assert {r["layout"] for r in rows} == {"1gpu", "dp2"}
    for name in ("1gpu", "dp2"):
        times = [r["time_s"] for r in rows if r["layout"] == name]
        assert times == sorted(times) and times[0] > 0
        assert all(0 <= r["test_error"] <= 1 for r in rows)
    assert (out / "curve.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "CURVE 1gpu: test error" in printed and "CURVE dp2: test error" in printed

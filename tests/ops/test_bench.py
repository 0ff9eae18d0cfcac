"""The benchmark's plumbing on CPU actors: layouts measured, anchors run, files written (no timing asserted).

The runs here use ``--precision fp32``: the bench's default bf16 autocast makes CPU convolutions about
ten times slower on CPUs without bf16 units, and nothing checked here depends on the precision.

A layout the bench measures takes actors that a training run of this process kept (``--keep-actors-s``:
the same count) where there are any, and stops them when it is measured; the tests run in an order where
the curve's runs keep theirs for the layouts of the call-limit test, and the bucket test's curve run its
actor for the sweep's first batch. Each test starts the actors it needs where none are kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import rayconv.bench.__main__ as bench
from rayconv.bench import anchor
from rayconv.bench.table import BENCH_SCHEMA, bench_table, write_table
from rayconv.layout import Layout
from rayconv.config import ConfigError


def test_parse_layout():
    assert Layout.parse("1gpu") == Layout(dp=1)
    assert Layout.parse("dp2xfs2") == Layout(dp=2, fs=2)
    assert Layout.parse("pp2m4") == Layout(dp=1, pp=2, num_microbatches=4)
    assert Layout.parse("pp2m4v2") == Layout(dp=1, pp=2, num_microbatches=4, virtual_stages=2)
    assert Layout.parse("plan4") == Layout(dp=4, plan="krizhevsky2014")
    assert Layout.parse("fs2c4") == Layout(dp=1, fs=2, exchange_chunks=4)
    assert Layout.parse("dp2xpp2").world_size == 4
    with pytest.raises(ConfigError, match="unknown layout"):
        Layout.parse("tp2")
    with pytest.raises(ConfigError, match="unknown layout"):
        Layout.parse("pp2c4")  # overlapped pieces belong to filter split
    with pytest.raises(ConfigError, match="zero count"):
        Layout.parse("fs2c0")


@pytest.mark.slow
def test_training_curve_writes_error_against_time(ray_cluster, tmp_path, capsys):
    out = tmp_path / "curve"
    rc = bench.main(["--curve", "--curve-epochs", "1", "--layouts", "1gpu,dp2", "--global-batch-size",
                     "128,256", "--device", "cpu", "--precision", "fp32", "--out", str(out)])
    assert rc == 0
    rows = pq.read_table(out / "curve.parquet").to_pylist()
    assert {(r["layout"], r["global_batch_size"]) for r in rows} == {(n, b) for n in ("1gpu", "dp2")
                                                                     for b in (128, 256)}
    for name in ("1gpu", "dp2"):
        for b in (128, 256):
            pts = [r for r in rows if r["layout"] == name and r["global_batch_size"] == b]
            times = [r["time_s"] for r in pts]
            assert times == sorted(times) and times[0] > 0
            assert pts[-1]["step"] + 1 == -(-1437 // b)  # one epoch of the 1,437 training digits
        assert all(0 <= r["test_error"] <= 1 for r in rows)
    assert (out / "curve.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "CURVE 1gpu B=128: test error" in printed and "CURVE dp2 B=256: test error" in printed


_BENCH: dict[str, Path] = {}


def bench_run(tmp_path: Path) -> Path:
    """The layout table's bench run (4 layouts, the anchors on) into ``tmp_path/bench``, which must exit
    0; its folder is kept for the module (one run serves the call-limit test, as the run after the
    stopped layouts, and the table test, which runs it itself when run alone)."""
    out = tmp_path / "bench"
    rc = bench.main(["--models", "convnet", "--layouts", "1gpu,dp2,pp2m2,fs2c2", "--image-size", "32",
                     "--global-batch-size", "32", "--steps", "2", "--warmup", "1", "--device", "cpu",
                     "--precision", "fp32", "--out", str(out)])
    assert rc == 0
    _BENCH["out"] = out
    return out


@pytest.mark.slow
def test_a_layout_past_its_call_limit_is_stopped_noted_and_the_bench_goes_on(ray_cluster, tmp_path, capsys):
    # A limit no step can meet: each layout is stopped at its first step and its row says why, instead
    # of the bench waiting on it; the actors are released, so the next layout and a later run get theirs.
    out = tmp_path / "limit"
    args = ["--models", "convnet", "--image-size", "32", "--global-batch-size", "32", "--steps", "2",
            "--warmup", "1", "--device", "cpu", "--precision", "fp32", "--no-anchors"]
    out.mkdir()
    (out / "speedup.png").write_bytes(b"an earlier run's chart")
    rc = bench.main(args + ["--layouts", "1gpu,dp2", "--call-timeout-s", "0.001", "--out", str(out)])
    assert rc == 1  # nothing was measured
    printed = capsys.readouterr()
    assert "rayconv.bench: error: no layout was measured" in printed.err
    table = pq.read_table(out / "bench.parquet")
    assert table.schema == BENCH_SCHEMA  # every column, though nothing was measured
    rows = table.to_pylist()
    assert [(r["layout"], r["world_size"]) for r in rows] == [("1gpu", 1), ("dp2", 2)]
    for r in rows:
        assert r["images_per_s"] is None
        assert r["note"].startswith("warm-up step 0: train_step did not finish within 0.001 s")
        assert "raise --call-timeout-s" in r["note"]
    assert "RESULT convnet dp2 B=32: failed: warm-up step 0" in printed.out
    assert not (out / "speedup.png").exists()  # an earlier run's chart does not stay beside failed rows
    # The later run: the layout table's (its dp2 row measured).
    assert pq.read_table(bench_run(tmp_path) / "bench.parquet").to_pylist()[1]["images_per_s"] > 0


@pytest.mark.slow   # (the bench run it reads, when the call-limit test did not make it)
def test_bench_writes_table_chart_and_anchor_ratios(ray_cluster, tmp_path):
    out = _BENCH.get("out") or bench_run(tmp_path)
    table = pq.read_table(out / "bench.parquet")
    assert table.schema == BENCH_SCHEMA
    rows = table.to_pylist()
    assert [r["layout"] for r in rows] == ["1gpu", "dp2", "pp2m2", "fs2c2"]
    for r in rows:
        assert r["images_per_s"] > 0 and r["step_ms"] > 0
        assert r["warmup_steps"] == 1   # (synthetic data: whole batches, the warm-up as asked)
        assert r["vs_plain_pytorch"] is not None and r["vs_plain_pytorch"] > 0
    assert rows[0]["speedup_vs_1"] == pytest.approx(1.0)
    assert rows[1]["vs_torchrun_ddp"] is not None  # the DDP anchor ran under torchrun with gloo
    # Each anchor timed every candidate configuration and counts its fastest, named in the row.
    for prefix, names in (("plain_pytorch", anchor.default_configs(False, False)),
                          ("torchrun_ddp", anchor.default_configs(True, False))):
        timed = json.loads(rows[1][f"{prefix}_candidates"])
        assert sorted(timed) == sorted(names) and len(names) >= (2 if prefix == "torchrun_ddp" else 1)
        assert all(v > 0 for v in timed.values())
        assert rows[1][f"{prefix}_config"] == max(timed, key=timed.get)
        assert rows[1][f"{prefix}_images_per_s"] == max(timed.values())
    assert rows[2]["num_microbatches"] == 2 and rows[2]["bubble_fraction"] > 0
    assert rows[1]["allreduce_wait_ms"] is not None and rows[2]["recv_wait_ms"] is not None
    # Filter split with 2 overlapped pieces per gather: the time its exchanges were waited for.
    assert rows[3]["exchange_chunks"] == 2 and rows[3]["exchange_exposed_ms"] > 0
    assert rows[1]["exchange_chunks"] is None and rows[1]["exchange_exposed_ms"] is None
    for r in rows:  # the same steps looped inside the actors, against the driver's loop
        assert r["in_actor_step_ms"] > 0 and r["driver_overhead"] == pytest.approx(
            1 - r["in_actor_step_ms"] / r["step_ms"])
    # Communication volume (parallel/comm.py: the bytes an actor hands to torch.distributed in a step):
    # a dp=2 replica all-reduces each fp32 gradient once (convnet has no batch norm: no buffers are
    # broadcast); one device communicates nothing; pipeline stages send activations and gradients.
    params = json.loads(rows[1]["params_per_actor"])
    assert params[0] == params[1] > 0
    assert rows[0]["comm_mb_per_step"] == 0 and rows[0]["comm_mb_per_step_total"] == 0
    assert rows[1]["comm_mb_per_step"] * 2**20 == params[0] * 4
    assert rows[1]["comm_mb_per_step_total"] * 2**20 == 2 * params[0] * 4
    assert rows[2]["comm_mb_per_step"] > 0
    assert (out / "bench.md").read_text().count("\n") == 2 + len(rows)
    assert (out / "speedup.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_and_curve_write_into_a_bucket(ray_cluster, tmp_path, monkeypatch, capsys):
    """``--out s3://...`` (a real S3-compatible server on loopback, moto): the layout table and the
    training curve go to the bucket, each file whole, nothing to the working folder; a bucket that does
    not exist is refused in one line before any layout runs (exit status 2)."""
    import io

    from rayconv.storage import locate
    from tests.support.s3_server import s3_server

    monkeypatch.chdir(tmp_path)
    with s3_server() as s3:
        uri = s3.uri("bench", "b1")
        rc = bench.main(["--models", "convnet", "--layouts", "1gpu", "--image-size", "32",
                         "--global-batch-size", "32", "--steps", "2", "--warmup", "1", "--device", "cpu",
                         "--precision", "fp32", "--no-anchors", "--out", uri])
        assert rc == 0 and f"results in {uri}" in capsys.readouterr().out
        rc = bench.main(["--curve", "--curve-epochs", "1", "--layouts", "1gpu", "--global-batch-size", "512",
                         "--device", "cpu", "--precision", "fp32", "--out", uri])
        assert rc == 0
        where = locate(uri)
        assert {"bench.parquet", "bench.md", "speedup.png", "curve.parquet", "curve.png",
                "curve-1gpu-B512"} <= set(where.listdir()), where.listdir()
        rows = pq.read_table(io.BytesIO((where / "bench.parquet").read_bytes())).to_pylist()
        assert [r["layout"] for r in rows] == ["1gpu"] and rows[0]["images_per_s"] > 0
        assert (where / "speedup.png").read_bytes()[:4] == b"\x89PNG"
        curve = pq.read_table(io.BytesIO((where / "curve.parquet").read_bytes())).to_pylist()
        assert curve and curve[-1]["step"] + 1 == -(-1437 // 512)
        assert (where / "curve-1gpu-B512" / "metrics.parquet").is_file()
        capsys.readouterr()
        assert bench.main(["--layouts", "1gpu", "--out", "s3://no-such-bucket/b1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("rayconv.bench: error: --out s3://no-such-bucket/b1: the bucket no-such-bucket "
                       "does not exist: create it, or name another"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bench_sweep_stops_at_max(ray_cluster, tmp_path):
    out = tmp_path / "sweep"
    rc = bench.main(["--models", "convnet", "--layouts", "1gpu", "--image-size", "32", "--sweep", "batch",
                     "--max-batch", "32", "--steps", "2", "--device", "cpu", "--precision", "fp32",
                     "--no-anchors", "--out", str(out)])
    assert rc == 0
    rows = pq.read_table(out / "sweep_batch.parquet").to_pylist()
    assert [r["batch_per_device"] for r in rows] == [16, 32] and all(r["fits"] for r in rows)


def test_bench_on_an_image_folder_reports_input_stall(ray_cluster, tmp_path):
    # A JPEG folder written by benchmarks/make_images.py, read through the real loader.
    root = tmp_path / "images"
    subprocess.run([sys.executable, str(Path(__file__).parents[2] / "benchmarks" / "make_images.py"),
                    str(root), "--classes", "2", "--train-per-class", "8", "--val-per-class", "1", "--width",
                    "50", "--height", "40", "--processes", "1"], check=True)
    files = sorted((root / "train").rglob("*.JPEG"))
    assert len(files) == 16 and files[0].read_bytes()[:2] == b"\xff\xd8"
    out = tmp_path / "bench"
    rc = bench.main(["--data", "imagefolder", "--data-dir", str(root), "--loader-workers", "0",
                     "--data-on-device", "off", "--models", "convnet", "--layouts", "1gpu", "--image-size",
                     "32", "--global-batch-size", "8", "--steps", "2", "--warmup", "1", "--device", "cpu",
                     "--precision", "fp32", "--out", str(out)])
    assert rc == 0
    row = pq.read_table(out / "bench.parquet").to_pylist()[0]
    assert row["data"] == "imagefolder" and row["images_per_s"] > 0
    assert 0 < row["input_stall_ms"] < row["step_ms"]  # (decoding in the actor: no loader processes)
    assert row["input_stall_fraction"] == pytest.approx(row["input_stall_ms"] / row["step_ms"])
    assert row["vs_plain_pytorch"] is None  # the anchors read synthetic data only
    assert bench.main(["--data", "imagefolder", "--layouts", "1gpu", "--out", str(tmp_path / "x")]) == 2


def test_a_failed_first_layout_keeps_the_measured_columns_of_the_rows_after_it(tmp_path):
    rows = [
        {"model": "m", "layout": "1gpu", "global_batch_size": 8, "note": "out of memory"},
        {
            "model": "m",
            "layout": "dp2",
            "global_batch_size": 8,
            "note": "",
            "images_per_s": 10.5,
            "world_size": 2,
        },
    ]
    write_table(rows, tmp_path)
    back = pq.read_table(tmp_path / "bench.parquet").to_pylist()
    assert [r["images_per_s"] for r in back] == [None, 10.5] and [r["world_size"] for r in back] == [None, 2]
    assert back[0]["note"] == "out of memory"
    with pytest.raises(ValueError, match="missing from BENCH_SCHEMA: \\['new_metric'\\]"):
        write_table([{**rows[1], "new_metric": 1.0}], tmp_path)


@pytest.mark.parametrize("limit", ["0", "-5", "nan", "inf", "1e20"])
def test_bench_refuses_a_call_limit_it_cannot_keep(tmp_path, capsys, limit):
    assert bench.main(["--layouts", "1gpu", "--call-timeout-s", limit, "--out", str(tmp_path / "x")]) == 2
    assert (
        f"--call-timeout-s {float(limit):g}: give a positive number of seconds up to 604800"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "x").exists()


def test_anchor_candidates_and_the_pick_of_the_fastest():
    ddp = anchor.default_configs(True, True)
    assert {"compile(ddp) bucket 25MB", "ddp(compile) bucket 25MB", "ddp bucket 25MB"} <= set(ddp)
    assert anchor.default_configs(False, True) == ["eager", "compile", "compile reduce-overhead"]
    assert anchor.default_configs(False, False) == ["eager"]
    timed = [{"config": "a", "images_per_s": 10.0}, {"config": "b", "error": "OutOfMemoryError: ..."},
             {"config": "c", "images_per_s": 12.5}]
    assert anchor.pick_fastest(timed)["config"] == "c"
    assert anchor.pick_fastest(timed[1:2]) is None
    with pytest.raises(SystemExit) as e:
        anchor.main(["--configs", "compile(ddp) bucket 25MB", "--device", "cpu"])  # a DDP one without --ddp
    assert e.value.code == 2


def test_paper_report_tables_from_a_run_folder(tmp_path):
    # benchmarks/report.py: the RQ tables of RESULTS.md from the parts' raw rows; a part not run says so,
    # and a multi-GPU row's speedup comes from the speed part's 1-GPU row when its own run had none.
    import runpy

    import pyarrow as pa

    run = tmp_path / "h200x2-2026-12-01-abc1234"
    for part, rows in {
        "speed": [
            {
                "model": "alexnet",
                "layout": "1gpu",
                "global_batch_size": 256,
                "world_size": 1,
                "images_per_s": 1000.0,
                "plain_pytorch_config": "compile",
                "comm_mb_per_step": 0.0,
            }
        ],
        "dp-mp": [
            {
                "model": "alexnet",
                "layout": "dp2",
                "global_batch_size": 256,
                "world_size": 2,
                "images_per_s": 1500.0,
                "torchrun_ddp_config": "ddp bucket 25MB",
                "comm_mb_per_step": 233.08,
            }
        ],
    }.items():
        (run / part).mkdir(parents=True)
        pq.write_table(bench_table(rows), run / part / "bench.parquet")
    (run / "batch").mkdir()
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "model": "alexnet",
                    "layout": "1gpu",
                    "batch_per_device": b,
                    "global_batch_size": b,
                    "fits": fits,
                    "images_per_s": 100.0 * b if fits else None,
                    "peak_gib_max": b / 8 if fits else None,
                    "note": None,
                }
                for b, fits in ((16, True), (32, True), (64, True), (128, False))
            ]
        ),
        run / "batch" / "sweep_batch.parquet",
    )
    # (its main, in this process: the same code as the command, without a second interpreter's imports)
    root = Path(__file__).resolve().parents[2]
    report = runpy.run_path(str(root / "benchmarks" / "report.py"), run_name="report")
    assert report["main"](["report", str(run)]) == 0
    text = (run / "report.md").read_text()
    assert (
        "| alexnet | dp2 | 2 | 256 | 1500 | 1.5 | not measured | not measured | not measured | ddp bucket"
        " 25MB | 233 |"
        in text
    )
    assert "| alexnet | 1gpu | 1 | 256 | 1000 | 1 | not measured | compile |" in text
    # RQ5: largest that trains (64, 8 GiB), first that does not (128), largest within 6 GiB (32, 4 GiB)
    assert "| alexnet | 1gpu | 64 | 8 | 128 | 32 |" in text
    assert "not measured (no convergence part in this run)" in text
    assert (run / "batch.png").stat().st_size > 1000 and (run / "memory.png").stat().st_size > 1000


def test_every_bench_flag_has_help_and_the_defaults_show(capsys):
    # python -m rayconv.bench --help: every option says what it does; the ones with a default say it.
    import re

    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entries = {m.group(1): m.group(2)
               for m in re.finditer(r"^  (--[a-z-]+)(.*?)(?=^  -|\Z)", options, re.M | re.S)}
    assert len(entries) > 20
    for flag, text in entries.items():
        words = re.sub(r"^[^ ]*( [A-Z_{},.a-z0-9-]+)?", "", text.strip().split("\n")[0]) + " ".join(
            text.split("\n")[1:]
        )
        assert words.strip(), f"{flag} has no help text"
    for flag in ("--global-batch-size", "--sweep", "--max-batch", "--precision", "--device"):
        assert "default" in entries[flag], f"{flag} does not show its default"

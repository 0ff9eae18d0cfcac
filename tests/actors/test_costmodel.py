"""The planner's cost model (rayconv.planner.costmodel), its search (rayconv.planner.search) and commands.

Costs known by construction: synthetic layer times and link speeds whose step times follow by hand;
the pipeline's timed makespan against the schedule's own unit-time simulation; memory accounting on
the real ConvNet; the command line on CPU, measuring for real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import ray

from rayconv.config import ConfigError
from rayconv.planner import costmodel, memory, search as layout_search
from rayconv.parallel import pipeline
from rayconv.layout import Layout
from rayconv.planner.links import Links, LinkSpeed
from rayconv.planner.memory import GIB
from rayconv.planner.profile import Profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Two layers: a "conv" (1000 parameters, 100 output elements per sample) and an FC layer (no
# parameters, 10 outputs), each taking 1 ms per sample forward + backward.
PROFILE = Profile("toy", in_elems=10, out_elems=(100, 10), params=(1000, 0), first_fc=1, gathers=(1,),
                  max_fs=2, flops=(1.0, 1.0))
# all-reduce: 1 ms latency + 1 ms per 4000 bus bytes; all-gather and send/recv: 1 ms per 1600 bytes.
LINKS = Links("toy", allreduce=LinkSpeed(4e-3, 1.0), allgather=LinkSpeed(1.6e-3), p2p=LinkSpeed(1.6e-3))


def times(batch: int, fs: int = 1) -> list[float]:
    return [1.0 * batch / fs, 1.0 * batch / fs]


def test_ranking_and_cost_split_are_exact():
    layouts = [Layout(dp=2), Layout(pp=2, num_microbatches=2), Layout(fs=2),
               Layout(dp=2, plan="krizhevsky2014")]
    fits, too_big = layout_search.rank(layouts, PROFILE, times, LINKS, 8)
    assert too_big == []
    got = {p.layout.name: (p.step_ms, p.compute_ms, p.exchange_ms, p.allreduce_ms, p.bubble_ms) for p in fits}
    expected = {
        # 4 images per replica: 8 ms; the 4000 gradient bytes all-reduced after the backward: 1 + 1 ms.
        "dp2": (10.0, 8.0, 0.0, 2.0, 0.0),
        # Half of 16 ms per actor; forward and backward each gather 3200 activation bytes (1 ms) and the
        # 320 bytes of logits (0.1 ms).
        "fs2": (10.2, 8.0, 2.2, 0.0, 0.0),
        # conv at 4 images (4 ms), FC split at 8 (4 ms); the batch gather and the logits as fs2; the
        # conv gradients' all-reduce starts when their backward ends.
        "plan2": (12.2, 8.0, 2.2, 2.0, 0.0),
        # 1F1B, 2 stages, 2 micro-batches of 4: F 4/3, B 8/3 ms per stage, each transfer 1 ms: 14 ms.
        "pp2m2": (14.0, 8.0, 0.0, 0.0, 6.0),
    }
    assert [p.layout.name for p in fits] == ["dp2", "fs2", "plan2", "pp2m2"]
    for name, want in expected.items():
        assert got[name] == pytest.approx(want, rel=1e-12, abs=1e-12), name
        assert sum(want[1:]) == pytest.approx(want[0])
    assert fits[0].images_per_s == pytest.approx(8 / 10.0 * 1e3)


def test_memory_limit_keeps_only_what_fits():
    layouts = [Layout(dp=2), Layout(pp=2, num_microbatches=2),
               Layout(pp=2, num_microbatches=2, schedule="gpipe")]
    preds = {p.layout.name: p for p in layout_search.rank(layouts, PROFILE, times, LINKS, 8)[0]}
    # GPipe holds both micro-batches on stage 0, 1F1B at most P - s = 2 there too (M = 2); dp2 holds
    # 4 whole samples' activations plus a fourth copy of the parameters (the gradient buckets).
    limit = (preds["pp2m2"].peak_gib + preds["dp2"].peak_gib) / 2
    assert preds["pp2m2"].peak_gib < limit < preds["dp2"].peak_gib
    fits, too_big = layout_search.rank(layouts, PROFILE, times, LINKS, 8, max_memory_gib=limit)
    assert {p.layout.name for p in too_big} == {"dp2"}
    assert fits[0].layout.name.startswith("pp2m2")


@pytest.mark.parametrize("name,P,M,V", [("gpipe", 2, 4, 1), ("gpipe", 3, 2, 1), ("1f1b", 2, 4, 1),
                                        ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("1f1b", 2, 4, 2),
                                        ("1f1b", 3, 6, 2)])
def test_bubble_matches_the_schedule_simulation(name, P, M, V):
    sched = pipeline.make_schedule(name, P, M, V)
    ones = [1.0] * (P * V)
    makespan, _, busy = costmodel.timed_makespan(sched, ones, ones, [0.0] * (P * V))
    assert makespan == len(pipeline.simulate(sched)[0])
    assert 1 - sum(busy) / (P * makespan) == pytest.approx(pipeline.bubble_fraction(sched), abs=1e-12)


def test_memory_accounting_on_the_convnet():
    from rayconv.config import Config
    from rayconv.planner.measure import profile_of
    from rayconv.models import ConvNet

    prof = profile_of(Config(model="convnet", device="cpu").to_dict())
    n_params = sum(p.numel() for p in ConvNet(1, 10).parameters())
    assert sum(prof["params"]) == n_params
    p = Profile(prof["model"], prof["in_elems"], tuple(prof["out_elems"]), tuple(prof["params"]),
                prof["first_fc"], tuple(prof["gathers"]), prof["max_fs"], tuple(prof["flops"]),
                tuple(prof["saved_elems"]))
    # conv1 saves its 1 x 8 x 8 input, its ReLU its 32 x 8 x 8 output; flatten saves nothing.
    assert prof["saved_elems"][:2] == [64, 32 * 64] and prof["saved_elems"][8] == 0
    acts = sum(prof["saved_elems"])  # per sample
    assert memory.peak_gib(Layout(), p, 4, "fp32") * GIB == 3 * n_params * 4 + 4 * acts * 4
    assert memory.peak_gib(Layout(), p, 4, "fp64") * GIB == 3 * n_params * 8 + 4 * acts * 8
    assert memory.peak_gib(Layout(dp=2), p, 8, "fp32") * GIB == 4 * n_params * 4 + 4 * acts * 4
    # The convnet's filter split gathers before conv2, conv3, fc1 and fc2 (and its logits at the end).
    assert prof["gathers"] == [2, 5, 9, 11] and prof["max_fs"] == 10


def test_a_run_that_cannot_fit_is_refused_by_the_check_without_cluster(tmp_path):
    """--max-memory-gib with --dp given: refused by the check a run makes while its actors start (no
    cluster needed; a ConfigError, which the command exits 2 with, in one line)."""
    from rayconv.driver.resolve import check_before_ray
    from rayconv.run import parse_command_line

    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "run"
    cfg = parse_command_line(["--dp", "1", "--device", "cpu", "--steps", "1", "--max-memory-gib", "0.00001",
                              "--out", str(out)])
    with pytest.raises(ConfigError) as e:
        check_before_ray(cfg, None)
    err = str(e.value)
    assert (
        len(err.splitlines()) == 1
        and "needs" in err
        and "GiB per device" in err
        and "--max-memory-gib" in err
    )
    assert re.search(r"layout 1gpu needs 0\.00\d+ GiB per device", err)
    assert not ray.is_initialized() and not out.exists()


@pytest.mark.slow
def test_plan_command_on_cpu_ranks_layouts_and_caches(tmp_path):
    env = {**os.environ, "RAYCONV_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rayconv.plan", "--device", "cpu", "--model", "convnet",
           "--global-batch-size", "8", "--json", str(tmp_path / "plan.json")]
    first = subprocess.run([*cmd, "--machine", "h200x4"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    assert "planner: [1/" in first.stderr and "planner: layer times measured in" in first.stderr   # progress
    assert "predicted by a cost model" in first.stdout
    predicted = first.stdout.split("\n\n")[1]
    assert (
        predicted.startswith("PREDICTION for 4 x H200, one host (4 GPUs;")
        and "links assumed, not measured" in predicted
    )
    assert "link table: NVLink 4" in predicted and "choice: " in predicted
    lines = first.stdout.split("\n\n")[0].splitlines()
    assert lines[2].split()[:3] == ["rank", "layout", "images/s"]
    rows = [ln.split() for ln in lines[3:] if ln.strip() and ln.split()[0].isdigit()]
    names = [r[1] for r in rows]
    assert {"dp2", "fs2", "plan2", "pp2m2", "pp2m2-gpipe"} <= set(names)
    rates = [float(r[2].replace(",", "")) for r in rows]
    assert rates == sorted(rates, reverse=True)
    assert any(ln.startswith(f"choice: {names[0]}: predicted") for ln in lines)
    ranked = json.loads((tmp_path / "plan.json").read_text())[0]["fits"]
    assert [r["layout"] for r in ranked] == names
    for r in ranked:
        assert r["step_ms"] == pytest.approx(
            r["compute_ms"] + r["exchange_ms"] + r["allreduce_ms"] + r["bubble_ms"]
        )
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "all measurements from the cache" in second.stdout
    assert float(re.search(r"planned in ([\d.]+) s", second.stdout).group(1)) < 1.0
    assert [ln.split()[1] for ln in second.stdout.splitlines()[3:3 + len(rows)]] == names


@pytest.fixture(scope="module")
def ray2():
    from conftest import local_ray

    yield from local_ray(2)


def test_layout_auto_runs_the_top_layout_and_records_the_prediction(ray2, tmp_path, monkeypatch):
    from rayconv.config import Config
    from rayconv.driver.job import train_run

    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "cache"))
    logs: list[str] = []
    cfg = Config(model="convnet", device="cpu", layout="auto", global_batch_size=16, steps=4, progress=False,
                 metrics=False, out=str(tmp_path / "run"))
    summary = train_run(cfg, log=logs.append)
    chosen = next(ln for ln in "\n".join(logs).splitlines() if ln.startswith("choice: "))
    name = summary["planner"]["predicted"]["layout"]
    assert chosen.startswith(f"choice: {name}: predicted")
    lay = summary["layout"]
    assert name == Layout(lay["dp"], lay["pp"], lay["fs"], lay["plan"], lay["num_microbatches"],
                          lay["schedule"] or "1f1b", lay["virtual_stages"]).name and lay["world_size"] == 2
    planner = summary["planner"]
    assert (
        planner["predicted_images_per_s"] > 0 and planner["measured_images_per_s"] == summary["images_per_s"]
    )
    assert planner["predicted_peak_gib"] > 0 and planner["measured_peak_gib"] is None  # (CPU: not measured)
    # The planner's progress (a line per batch size measured) and its error (predicted beside measured) show.
    assert any(ln.startswith("planner: [1/") for ln in logs) and any(
        ln.startswith("planner: layer times measured in") for ln in logs
    )
    ratio = planner["measured_images_per_s"] / planner["predicted_images_per_s"]
    assert f"measured {planner['measured_images_per_s']:.0f} ({ratio:.2f}x the prediction" in logs[-1], logs[
        -1
    ]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["layout"] == "manual" and saved["dp"] == lay["dp"] and saved["pp"] == lay["pp"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["planner"] == planner


def test_links_measured_between_two_actors(ray2):
    from rayconv.cluster import tasks as cluster
    from rayconv.planner.measure import fit_links, link_probe

    probe = cluster.run_on_devices(link_probe, 2, False, ("gloo", (0.0625, 0.25)))[0]
    assert len(probe["allreduce"]) == len(probe["allgather"]) == len(probe["p2p"]) == 2
    links = fit_links(probe, 2, "cpu x 2")
    for speed in (links.allreduce, links.allgather, links.p2p):
        assert speed.gbps > 0 and speed.latency_ms >= 0
    assert "measured between 2 actors" in links.source


def test_layout_names_are_the_bench_names():
    prof = Profile("toy", 3, (8,) * 12, (1,) * 12, first_fc=10, max_fs=8)
    layouts = layout_search.candidates(prof, 8, 256)
    names = {lay.name for lay in layouts}
    assert {"dp8", "dp4xpp2m4v2", "dp2xpp2m4xfs2-gpipe", "dp4xfs2", "pp2m2xfs4", "plan8"} <= names
    for lay in layouts:
        assert Layout.parse(lay.name) == lay, lay.name  # (rayconv.layout: the bench's parser too)


def test_layout_auto_refuses_when_no_layout_fits(ray2, tmp_path, monkeypatch):
    from rayconv.config import Config, ConfigError
    from rayconv.driver.job import train_run

    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "cache"))
    cfg = Config(model="convnet", device="cpu", layout="auto", global_batch_size=16, steps=2, progress=False,
                 metrics=False, max_memory_gib=1e-6, out=str(tmp_path / "run"))
    with pytest.raises(ConfigError,
                       match=r"none fits in 1e-06 GiB per device; the smallest needs [\d.e-]+ GiB"):
        train_run(cfg, log=lambda *_: None)
    assert not (tmp_path / "run").exists()

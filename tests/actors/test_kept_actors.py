"""Actors kept from a finished run (``--keep-actors-s``, ``cluster.pool``) serve the next run of the
same process that needs the same actors, exactly as new ones would; other runs get their own, beside
the kept ones while the cluster has room for both, and a smaller run that has no room takes the first
actors of a larger kept group."""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch

from support.helpers import assert_same_state, reference_sgd, sgd_config
from rayconv.cluster import pool
from rayconv.cluster.connect import cli_address
from rayconv.driver.job import train_run

STEPS = 3   # (a few steps: each run is compared to the bit with another run or single-device SGD)


def _run(cfg, seen: dict, name: str) -> dict:
    def on_step(actor_group, step):
        if step == 0:
            seen[name] = ([i["pid"] for i in actor_group.info], actor_group.reused)
    return train_run(cfg, log=lambda *_: None, on_step=on_step)


def _pg_state(run_name: str) -> str:
    return next(pg["state"] for pg in ray.util.placement_group_table().values()
                if pg["name"] == f"rayconv/{run_name}")


@pytest.mark.slow
def test_kept_actors_train_the_next_run_exactly_and_other_runs_get_their_own(ray_cluster, tmp_path):
    seen: dict = {}
    a = sgd_config(tmp_path, "a", dp=2, steps=STEPS, eval_every=STEPS)
    _run(a, seen, "a")
    model_a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    assert not seen["a"][1] and pool.kept_group() is not None
    # The same run again: the same processes, the same model to the bit (nothing of run a stayed in them).
    _run(sgd_config(tmp_path, "b", dp=2, steps=STEPS, eval_every=STEPS), seen, "b")
    assert seen["b"] == (seen["a"][0], True)
    assert_same_state(torch.load(tmp_path / "b" / "model.pt", weights_only=True), model_a, atol=0.0)
    # Another layout of two actors: renewed as pipeline stages, still single-device SGD.
    c = sgd_config(tmp_path, "c", pp=2, num_microbatches=2, steps=STEPS, eval_every=STEPS)
    _run(c, seen, "c")
    assert seen["c"] == (seen["a"][0], True)
    assert_same_state(torch.load(tmp_path / "c" / "model.pt", weights_only=True), reference_sgd(c, STEPS),
                      atol=1e-10)
    # A kept actor that died while kept: the next run starts its own, and trains the same.
    ray.kill(pool.kept_group().actors[0])
    d = _run(sgd_config(tmp_path, "d", dp=2, steps=STEPS, eval_every=STEPS), seen, "d")
    assert not seen["d"][1] and not set(seen["d"][0]) & set(seen["a"][0])
    assert_same_state(torch.load(tmp_path / "d" / "model.pt", weights_only=True), model_a, atol=0.0)
    # A run of one actor fits beside the two kept (3 of the 4 CPUs): they stay kept, and so do its own;
    # the next run of two takes d's actors again.
    e = _run(sgd_config(tmp_path, "e", dp=1, steps=2, eval_every=2), seen, "e")
    assert not seen["e"][1] and not set(seen["e"][0]) & set(seen["d"][0])
    assert [len(g.actors) for g in pool.kept_groups()] == [2, 1]
    assert pool.kept_resources()["CPU"] == 3.0   # (the two groups' placement groups: 2 + 1 bundles of 1 CPU)
    _run(sgd_config(tmp_path, "f", dp=2, steps=STEPS, eval_every=STEPS), seen, "f")
    assert seen["f"] == (seen["d"][0], True)
    assert [len(g.actors) for g in pool.kept_groups()] == [1, 2]
    # A run that needs all 4 CPUs (one actor of 4) stops both kept groups (their placement groups removed),
    # the longest unused first; with --keep-actors-s 0 it leaves nothing: every CPU is free again.
    _run(sgd_config(tmp_path, "g", dp=1, num_cpus_per_actor=4, steps=2, eval_every=2, keep_actors_s=0), seen,
         "g")
    assert not seen["g"][1] and _pg_state(d["run_name"]) == _pg_state(e["run_name"]) == "REMOVED"
    assert pool.kept_group() is None
    deadline = time.monotonic() + 10   # (ray.kill ends the processes asynchronously)
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4


def test_a_run_that_does_not_fit_beside_a_larger_kept_group_takes_its_first_actors(ray_cluster, tmp_path):
    # --dp from the cluster (4 CPUs, 2 per actor: 2 replicas) reads the cluster's totals, which kept actors
    # do not change. The pair's two kept actors hold the cluster's 4 CPUs: a run of one actor of 2 CPUs
    # takes the first (the same process, single-device SGD still), the other rests in the placement group
    # and is kept with it again, so the next run with --dp from the cluster (2 replicas again) takes both
    # and trains as the first did, to the bit.
    pool.release()
    seen: dict = {}
    logged: list[str] = []
    _run(sgd_config(tmp_path, "pair", dp=None, num_cpus_per_actor=2, steps=2, eval_every=2), seen, "pair")
    assert len(seen["pair"][0]) == 2 and not seen["pair"][1] and pool.kept_group() is not None
    one = sgd_config(tmp_path, "one", dp=1, num_cpus_per_actor=2, steps=3, eval_every=3)
    train_run(
        one,
        log=logged.append,
        on_step=lambda g, k: k
        or seen.setdefault("one", ([i["pid"] for i in g.info], g.reused, len(g.spare))),
    )
    assert seen["one"] == (seen["pair"][0][:1], True, 1)
    [line] = [x for x in logged if "1 of the 2 actors kept from this process's previous run, reused" in x]
    # (Ray renames no named actor: the line names those the cluster lists, the first run's)
    first = json.loads((tmp_path / "pair" / "summary.json").read_text())["run_name"]
    assert f'keep the names rayconv/{first}/<role> of the run that started them' in line, line
    at = f"RAY_ADDRESS={cli_address()} " if cli_address() else ""   # (other Rays on the host: named)
    assert f'`{at}ray list actors --filter "name=rayconv/{first}/dp0"`' in line, line
    assert_same_state(torch.load(tmp_path / "one" / "model.pt", weights_only=True), reference_sgd(one, 3),
                      atol=1e-10)
    assert [len(g.actors) for g in pool.kept_groups()] == [2] and not pool.kept_groups()[0].spare
    _run(sgd_config(tmp_path, "again", dp=None, num_cpus_per_actor=2, steps=2, eval_every=2), seen, "again")
    assert seen["again"] == (seen["pair"][0], True)
    assert_same_state(torch.load(tmp_path / "again" / "model.pt", weights_only=True),
                      torch.load(tmp_path / "pair" / "model.pt", weights_only=True), atol=0.0)
    pool.release()


@pytest.mark.slow
def test_a_run_in_a_given_placement_group_gets_the_bundles_a_kept_group_held(ray_cluster, tmp_path):
    # As in a Tune trial's process (its placement group given: the process's bundle, then the actors'):
    # a run of one actor keeps it in the group's last bundle; the next run, of two, needs that bundle
    # too, so the kept actor is stopped for it instead of the run waiting out its start-up limit.
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def two_runs(cfgs: list) -> list:
        from rayconv.driver.job import train_run as run

        seen = []
        for cfg in cfgs:
            run(cfg, log=lambda *_: None, on_step=lambda g, k: k or seen.append([i["pid"] for i in g.info]))
        return seen

    cfgs = [sgd_config(tmp_path, name, dp=dp, steps=2, eval_every=2, max_wait=60)
            for name, dp in (("one", 1), ("two", 2))]

    pg = placement_group([{"CPU": 1}] * 3, strategy="PACK")
    ray.get(pg.ready(), timeout=30)
    try:
        task = ray.remote(num_cpus=1)(two_runs).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True))
        one, two = ray.get(task.remote(cfgs), timeout=240)
    finally:
        remove_placement_group(pg)
    assert len(one) == 1 and len(two) == 2 and one[0] not in two
    for name in ("one", "two"):
        assert json.loads((tmp_path / name / "summary.json").read_text())["status"] == "finished"

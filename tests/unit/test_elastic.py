"""--elastic without Ray: the free-device count, the refusals, the run rebuilt on another layout, and
the stop below the minimum (one line naming the checkpoint kept and the resume command; exit status 2).
The rules alone (plan, resize, wait, stop) are tests/unit/test_policies.py's.

The elastic run itself (a node removed and added back, an actor's SIGTERM) is
tests/ops/test_multinode.py's ``test_elastic_dp4_shrinks_grows_and_loses_no_step``."""

from __future__ import annotations

import time

import pytest

from rayconv import run as run_cli
from rayconv.config import Config
from rayconv.cluster.nodes import free_devices
from rayconv.driver.elastic import continue_mesh
from rayconv.driver.policies import ElasticScaling
from rayconv.errors import ConfigError, TooFewDevices
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import write_checkpoint


def test_free_devices_leave_draining_nodes_out_and_count_slots():
    per_node = {"a": {"CPU": 4.0, "GPU": 2.0}, "b": {"CPU": 3.0}, "c": {"CPU": 8.0, "GPU": 8.0}}
    assert free_devices(per_node, set(), "cpu", 2) == 2 + 1 + 4
    assert free_devices(per_node, {"c"}, "cpu", 1) == 7
    assert free_devices(per_node, {"c"}, "cuda", 1) == 2
    assert free_devices({"a": {"CPU": 1.0, "GPU": 4.0}}, set(), "cuda", 1) == 1   # (a CPU per GPU actor)


def test_elastic_refusals_are_one_line():
    base = dict(model="convnet", data="digits", device="cpu")
    with pytest.raises(ConfigError, match="--checkpoint-every") as e:
        Config(**base, dp=4, elastic=2).validate()
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="above the layout's 4 actors: give --elastic 4 or less"):
        Config(**base, dp=2, pp=2, elastic=5, checkpoint_every=2).validate()
    with pytest.raises(ConfigError, match="--elastic must be >= 1"):
        Config(**base, elastic=0, checkpoint_every=2).validate()
    Config(**base, elastic=8, checkpoint_every=2).validate()   # (dp from the cluster: checked once known)


def test_below_the_minimum_waits_then_stops_with_one_line_and_the_checkpoint_kept(
        tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    ckpt = write_checkpoint(out, 4, [b"rank file"], {"layout": {}})
    cfg = Config(model="convnet", data="digits", device="cpu", dp=4, elastic=3, checkpoint_every=2,
                 global_batch_size=96, max_wait=0.6).validate()
    policy = ElasticScaling(Mesh(4, 1, 1), 3, cfg.global_batch_size, cfg.num_microbatches)
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(TooFewDevices) as e:
        continue_mesh(policy, cfg.max_wait, out, lines.append, free=lambda: 2)
    assert time.monotonic() - t0 >= 0.6, "it waits --max-wait before it stops"
    assert lines == ["rayconv: 2 devices free, --elastic needs 3: waiting up to 1 s (--max-wait)"]
    msg = str(e.value)
    assert "\n" not in msg and f"last checkpoint {ckpt} kept" in msg
    assert msg.endswith(f"continue with `python -m rayconv.run --resume {out}`")
    assert (ckpt / "rank-0.pt").read_bytes() == b"rank file"
    # Devices that come back within the wait: the run goes on, on what the rule picks.
    seen = iter([1, 2, 3, 4])
    assert continue_mesh(policy, cfg.max_wait, out, lines.append, free=lambda: next(seen)) == Mesh(3, 1, 1)
    # The command line's exit status for it is 2, its line alone on stderr.

    def stop(cfg):
        raise TooFewDevices(msg)

    monkeypatch.setattr("rayconv.api.start_and_train", stop)
    capsys.readouterr()
    assert run_cli.main(["--dp", "4", "--elastic", "3", "--checkpoint-every", "2", "--out",
                         str(out / "x")]) == 2
    assert capsys.readouterr().err == f"rayconv: error: {msg}\n"



def test_a_changes_phases_read_as_the_seconds_each_took():
    from rayconv.driver.elastic import phase_words
    got = phase_words({"devices_free": 1.0, "actors_alive": 4.5, "actors_set_up": 7.0, "first_step": 7.25})
    assert got == "stopped, devices free 1.0 s, actors started 3.5 s, set up 2.5 s, first step 0.2 s"


def test_the_run_on_another_layout_is_rebuilt_with_one_dp(tmp_path):
    """``ResolvedRun.on_mesh``: the run on the new mesh, whose dp the settings and the sharding read
    (dp is stored once: the mesh); the pipeline cut and the rest kept; a change of pp is refused."""
    import dataclasses

    from rayconv.data.source import Sharding
    from rayconv.driver.resolve import ResolvedRun, check_before_ray

    cfg = Config(steps=10, dp=4, pp=2, device="cpu", progress=False, global_batch_size=64, num_microbatches=2,
                 loader_workers=0, out=str(tmp_path)).validate()
    source, _, _, routing = check_before_ray(cfg, None)
    sharding = Sharding(source.train_size, cfg.global_batch_size, cfg.seed)
    start = ResolvedRun(settings=cfg, routing=routing, source=source, sharding=sharding,
                        total_steps=10, eval_every=5, out=tmp_path, run_name="r-1", resume=None,
                        predicted=None, t_start=0.0)
    assert start.settings.dp is None and start.cfg == cfg and start.mesh == Mesh(4, 2, 1)
    assert "dp" not in {f.name for f in dataclasses.fields(Sharding)}
    two = start.on_mesh(Mesh(2, 2, 1))
    assert (two.cfg.dp, two.mesh, two.routing.mesh) == (2, Mesh(2, 2, 1), Mesh(2, 2, 1))
    assert two.sharding is start.sharding and two.settings is start.settings
    assert two.routing.stages == start.routing.stages and two.cfg.pp == 2 and two.total_steps == 10
    assert start.on_mesh(Mesh(4, 2, 1)) is start and two.on_mesh(Mesh(4, 2, 1)).cfg == start.cfg
    with pytest.raises(ValueError, match="only its dp"):
        start.on_mesh(Mesh(4, 1, 1))


def test_an_elastic_run_recovers_every_loss_by_default_and_a_spent_budget_names_max_failures(tmp_path):
    """--elastic without --max-failures: every loss is recovered (the budget -1, Ray Train's "no limit";
    the run stops only below MIN, above); with --max-failures N, or without --elastic (0), the loss past
    the budget ends the run in one line naming --max-failures."""
    from types import SimpleNamespace

    from rayconv.driver.job import Controller, decide_after_loss
    from rayconv.driver.policies import FailurePolicy
    from rayconv.driver.saving import Checkpoints
    from rayconv.errors import ClusterError

    lost = ClusterError("actor dp1 (rank 1) was lost (process or node died) in train_step", recoverable=True)

    def run_of(cfg: Config):
        lines: list[str] = []
        return SimpleNamespace(cfg=cfg.validate(), failures=0, log=lines.append, checkpoints=Checkpoints(),
                               resolved=SimpleNamespace(out=tmp_path, resume=None)), lines

    def recover(run) -> object:   # the controller's step after a loss, as without --elastic (a restart)
        policy = FailurePolicy(run.cfg.failure_budget)
        e, decision = decide_after_loss(lost, run, policy)
        return Controller(run.cfg, None, run.log, None, None).after_loss(run, e, decision)

    run, lines = run_of(Config(dp=4, elastic=2, checkpoint_every=2))
    for _ in range(5):
        assert recover(run) is None   # (no checkpoint written yet: from the start)
    assert run.failures == 5 and "recovering (5; --max-failures -1: no limit)" in lines[-1]
    capped, _ = run_of(Config(dp=4, elastic=2, checkpoint_every=2, max_failures=1))
    recover(capped)
    with pytest.raises(ClusterError) as e:
        recover(capped)
    msg = str(e.value)
    assert "1 of --max-failures 1 recovered: give --max-failures N" in msg and "\n" not in msg
    plain, _ = run_of(Config(dp=4))
    with pytest.raises(ClusterError, match="0 of --max-failures 0 recovered: give --max-failures N"):
        recover(plain)

"""Unit tests without Ray: configuration, mesh arithmetic, data sharding, flat layer views, stage balancing."""

from __future__ import annotations

import itertools
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from rayconv.config import Config, ConfigError
from rayconv.flags import parse_args
from rayconv.data import source as data_mod
from rayconv.data.digits import digits_arrays
from rayconv.data.source import Sharding
from rayconv.data.synthetic import SyntheticSource
from rayconv.mesh import AXES, Mesh
from rayconv.models import ConvNet, build_model, run_layers, to_layers
from rayconv.parallel.pipeline.stages import balance, parse_stages
from rayconv.errors import PlanError


# ---------------------------------------------------------------------- config
def test_no_flags_gives_the_defaults():
    assert parse_args([]) == Config()


def test_flags_set_fields():
    cfg = parse_args(["--model", "alexnet", "--data", "synthetic", "--dp", "2", "--pp", "3", "--fs", "2",
                      "--global-batch-size", "128", "--lr", "0.1", "--steps", "7", "--precision", "bf16",
                      "--no-progress", "--sync-batchnorm", "--stages", "5,9", "--out", "somewhere"])
    assert (cfg.model, cfg.data, cfg.dp, cfg.pp, cfg.fs) == ("alexnet", "synthetic", 2, 3, 2)
    assert cfg.global_batch_size == 128 and isinstance(cfg.global_batch_size, int)
    assert cfg.lr == 0.1 and isinstance(cfg.lr, float)
    assert (cfg.steps, cfg.precision, cfg.stages, cfg.out) == (7, "bf16", "5,9", "somewhere")
    assert cfg.progress is False and cfg.sync_batchnorm is True
    # Untouched fields keep their defaults.
    assert cfg.momentum == Config().momentum and cfg.seed == Config().seed


def test_bad_flag_type_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--dp", "two"])
    assert e.value.code == 2
    assert "--dp" in capsys.readouterr().err


def test_config_file_with_flags_overriding(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "resnet18", "data": "synthetic", "lr": 0.2, "dp": 4, "steps": 3}))
    cfg = parse_args(["--config", str(path), "--lr", "0.01", "--steps", "9"])
    assert (cfg.model, cfg.data, cfg.dp) == ("resnet18", "synthetic", 4)   # from the file
    assert (cfg.lr, cfg.steps) == (0.01, 9)                                 # flags win
    assert cfg.global_batch_size == Config().global_batch_size             # neither: default


def test_written_config_reads_back(tmp_path):
    cfg = Config(model="vgg11", data="synthetic", dp=3, image_size=64, steps=11, progress=False,
                 out=str(tmp_path / "x")).validate()
    cfg.to_json(tmp_path / "config.json")
    # Everything but the output folder (a re-run writes to a new one unless --out says).
    assert parse_args(["--config", str(tmp_path / "config.json")]) == dataclasses.replace(cfg, out=None)


def test_unknown_key_in_config_file_is_rejected(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "convnet", "learning_rate": 0.1}))
    with pytest.raises(ConfigError, match="learning_rate"):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize("content, match", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_malformed_config_file(tmp_path, content, match):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as e:
        parse_args(["--config", str(path)])
    assert "--config" in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="--config .*no such file"):
        parse_args(["--config", str(tmp_path / "nope.json")])


def test_exchange_chunks_without_filter_split_are_refused():
    with pytest.raises(ConfigError, match="--exchange-chunks 4 applies to filter split's gathers: add --fs 2"):
        parse_args(["--exchange-chunks", "4"])
    assert parse_args(["--exchange-chunks", "4", "--fs", "2"]).exchange_chunks == 4


def test_bad_value_in_config_file_names_the_flag(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"pp": 0}))
    with pytest.raises(ConfigError, match="--pp"):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize("argv, match", [
    (["--dp", "1", "--pp", "2", "--global-batch-size", "64", "--num-microbatches", "5"],
     r"--num-microbatches 5 does not divide the per-replica batch 64 \(= --global-batch-size 64 / dp 1\)"),
    (["--dp", "2", "--pp", "2", "--global-batch-size", "8", "--num-microbatches", "8"],
     "--num-microbatches 8 exceeds the per-replica batch 4"),
])
def test_microbatches_that_do_not_split_the_batch_are_refused_before_ray_starts(argv, match):
    """Checked with the settings (parse_args validates), not after Ray has started; with --dp left to the
    cluster the plan checks it once dp is known (same message)."""
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)
    assert parse_args(argv[:-1] + ["4"]).num_microbatches == 4


@pytest.mark.parametrize("argv, match", [
    (["--virtual-stages", "2"], "set --pp 2 or more"),
    (["--pp", "2", "--virtual-stages", "2", "--schedule", "gpipe"], "use --schedule 1f1b, not gpipe"),
    (["--pp", "2", "--fs", "2", "--virtual-stages", "2", "--num-microbatches", "2"], "does not combine with --fs"),
    (["--pp", "2", "--virtual-stages", "2", "--num-microbatches", "3", "--global-batch-size", "96"],
     r"set --num-microbatches to a multiple of 2 \(got 3\)"),
    (["--pp", "2", "--virtual-stages", "0"], "--virtual-stages must be >= 1"),
])
def test_bad_virtual_stages_are_refused_with_what_to_change(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


def test_more_chunks_than_layers_is_a_plan_error():
    from rayconv.mesh import Mesh
    from rayconv.models import build_model
    from rayconv.errors import PlanError
    from rayconv.parallel.layout_plan import make_plan

    cfg = Config(model="convnet", data="digits", pp=2, dp=1, virtual_stages=7, num_microbatches=2,
                 global_batch_size=8).validate()
    with pytest.raises(PlanError, match="into 14 chunks but it has 12 cuttable layers: lower --virtual-stages"):
        make_plan(cfg, Mesh(dp=1, pp=2, fs=1), build_model("convnet", 10, 1, 8), (1, 8, 8))



@pytest.mark.parametrize("argv, flag", [
    (["--pp", "0"], "--pp"),
    (["--fs", "0"], "--fs"),
    (["--dp", "0"], "--dp"),
    (["--steps", "0"], "--steps"),
    (["--epochs", "-1"], "--epochs"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--num-microbatches", "0"], "--num-microbatches"),
    (["--num-classes", "0"], "--num-classes"),
    (["--eval-every", "0"], "--eval-every"),
    (["--lr", "0"], "--lr"),
    (["--momentum", "1.0"], "--momentum"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--image-size", "0"], "--image-size"),  # (below 32 is each model's to refuse: build_model)
    (["--loader-workers", "-1"], "--loader-workers"),
    (["--collective-timeout-s", "0"], "--collective-timeout-s"),
    (["--data", "imagefolder"], "--data-dir"),
    (["--plan", "krizhevsky2014", "--pp", "2"], "--pp"),
])
def test_validation_error_names_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert flag in str(e.value)


# ---------------------------------------------------------------------- mesh
MESHES = [(1, 1, 1), (4, 1, 1), (1, 3, 1), (1, 1, 4), (2, 3, 2), (3, 2, 4), (2, 1, 3)]


@pytest.mark.parametrize("shape", MESHES)
def test_mesh_rank_coord_round_trip(shape):
    mesh = Mesh(*shape)
    assert mesh.world_size == shape[0] * shape[1] * shape[2]
    coords = [mesh.coord(r) for r in range(mesh.world_size)]
    assert sorted(coords) == list(itertools.product(*(range(n) for n in shape)))  # a bijection
    for r, c in enumerate(coords):
        assert mesh.rank(c) == r
        assert mesh.rank(tuple(c)) == r
    assert mesh.coord(mesh.world_size - 1) == tuple(n - 1 for n in shape)


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("axis", AXES)
def test_mesh_groups_partition_the_ranks(shape, axis):
    mesh = Mesh(*shape)
    i = AXES.index(axis)
    groups = mesh.groups(axis)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(mesh.world_size))           # every rank exactly once
    assert len(groups) == mesh.world_size // shape[i]
    for g in groups:
        assert len(g) == shape[i]
        cs = [mesh.coord(r) for r in g]
        assert [c[i] for c in cs] == list(range(shape[i]))         # in coordinate order
        others = {tuple(v for j, v in enumerate(c) if j != i) for c in cs}
        assert len(others) == 1                                     # differ only along `axis`
        for r in g:
            assert mesh.group_of(r, axis) == g


@pytest.mark.parametrize("shape", MESHES)
def test_fs_groups_are_contiguous_ranks(shape):
    mesh = Mesh(*shape)
    for g in mesh.groups("fs"):
        assert g == list(range(g[0], g[0] + mesh.fs))


def test_mesh_role_names():
    assert Mesh(1, 1, 1).role(0) == "dp0"
    assert [Mesh(3, 1, 1).role(r) for r in range(3)] == ["dp0", "dp1", "dp2"]
    assert [Mesh(1, 2, 1).role(r) for r in range(2)] == ["pp0", "pp1"]
    assert [Mesh(1, 1, 2).role(r) for r in range(2)] == ["fs0", "fs1"]
    assert Mesh(2, 2, 2).role(5) == "dp1-pp0-fs1"
    assert Mesh(2, 3, 1).role(5) == "dp1-pp2"
    for shape in MESHES:
        mesh = Mesh(*shape)
        roles = [mesh.role(r) for r in range(mesh.world_size)]
        assert len(set(roles)) == len(roles)


def test_mesh_rejects_degree_zero():
    with pytest.raises(ValueError, match="fs"):
        Mesh(2, 1, 0)


# ---------------------------------------------------------------------- sharding
SHARDINGS = [(1438, 102, 4), (1438, 64, 2), (10, 3, 3), (7, 7, 2), (5, 8, 2), (100, 10, 1), (9, 4, 4)]


@pytest.mark.parametrize("n, batch, dp", SHARDINGS)
def test_each_epoch_covers_every_train_sample_once(n, batch, dp):
    sh = Sharding(n, batch, dp, seed=3)
    assert sh.steps_per_epoch == -(-n // batch)
    for epoch in range(3):
        batches = [sh.global_batch(epoch, s) for s in range(sh.steps_per_epoch)]
        assert all(len(b) == batch for b in batches[:-1])
        assert 1 <= len(batches[-1]) <= batch
        assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(n))


@pytest.mark.parametrize("n, batch, dp", SHARDINGS)
def test_replica_slices_split_the_global_batch(n, batch, dp):
    sh = Sharding(n, batch, dp, seed=5)
    for epoch in range(2):
        for s in range(sh.steps_per_epoch):
            whole = sh.global_batch(epoch, s)
            parts = [sh.replica_batch(epoch, s, r) for r in range(dp)]
            assert all(count == len(whole) for _, count in parts)
            idx = [p for p, _ in parts]
            assert np.array_equal(np.concatenate(idx), whole)         # disjoint, cover, in order
            sizes = [len(p) for p in idx]
            assert max(sizes) - min(sizes) <= 1


def test_sharding_is_deterministic_and_depends_on_seed_and_epoch():
    a, b = Sharding(500, 32, 4, seed=1), Sharding(500, 32, 4, seed=1)
    for epoch, s, r in [(0, 0, 0), (0, 15, 3), (2, 7, 1)]:
        assert np.array_equal(a.replica_batch(epoch, s, r)[0], b.replica_batch(epoch, s, r)[0])
    assert not np.array_equal(a.global_batch(0, 0), a.global_batch(1, 0))                        # reshuffled
    assert not np.array_equal(a.global_batch(0, 0), Sharding(500, 32, 4, seed=2).global_batch(0, 0))


@pytest.mark.parametrize("n, dp", [(359, 4), (360, 4), (6, 2), (3, 4), (1, 1), (17, 5)])
def test_test_shard_covers_the_test_set_once(n, dp):
    shards = [data_mod.test_shard(n, dp, r) for r in range(dp)]
    assert np.array_equal(np.concatenate(shards), np.arange(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------- flat layer views
@pytest.mark.parametrize("name, shape", [
    ("convnet", (1, 8, 8)),
    ("convnet-bn", (3, 32, 32)),
    ("alexnet", (3, 64, 64)),
    ("resnet18", (3, 32, 32)),
    ("vgg11", (3, 32, 32)),
])
def test_flat_layers_compute_the_model(name, shape):
    torch.manual_seed(0)
    if name == "convnet-bn":
        model = ConvNet(shape[0], 10, batch_norm=True)
    else:
        model = build_model(name, 10, shape[0], shape[1])
    model = model.double().eval()
    if name in ("convnet-bn", "resnet18"):
        # Non-trivial batch-norm statistics, so that eval mode actually uses them.
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    layers = to_layers(model)
    assert len(layers) > 1, "a known family must be cuttable"
    # The flat view holds the model's own parameters, all of them.
    flat_params = {id(p) for _, m in layers for p in m.parameters()}
    assert flat_params == {id(p) for p in model.parameters()}
    x = torch.randn(3, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        got = run_layers(layers, x)
    assert want.shape == (3, 10)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unknown_family_is_one_layer():
    model = torch.nn.Module()
    assert to_layers(model) == [("", model)]


# ---------------------------------------------------------------------- stage balancing
def _max_stage(costs, bounds):
    return max(sum(costs[a:b]) for a, b in bounds)


def _brute_force(costs, k):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        best = min(best, _max_stage(costs, list(zip(edges, edges[1:]))))
    return best


def _check_bounds(bounds, n, k):
    assert len(bounds) == k
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds)                               # non-empty
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))  # contiguous


@pytest.mark.parametrize("costs, k, want", [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),
    ([1, 1, 1, 1, 1, 5], 2, [(0, 5), (5, 6)]),
    ([3, 3, 3], 3, [(0, 1), (1, 2), (2, 3)]),
    ([0, 0, 0], 3, [(0, 1), (1, 2), (2, 3)]),
    ([4, 2, 7], 1, [(0, 3)]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [(0, 5), (5, 7), (7, 9)]),  # 15 | 13 | 17: max 17 is optimal
])
def test_balance_hand_cases(costs, k, want):
    got = balance(costs, k)
    _check_bounds(got, len(costs), k)
    assert _max_stage(costs, got) == _max_stage(costs, want) == _brute_force(costs, k)
    if costs != [1, 2, 3, 4, 5, 6, 7, 8, 9]:   # unique optimum
        assert got == want


def test_balance_is_optimal_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        costs = [float(c) for c in rng.integers(0, 20, n)]
        got = balance(costs, k)
        _check_bounds(got, n, k)
        assert _max_stage(costs, got) == _brute_force(costs, k), (costs, k, got)


def test_balance_more_stages_than_layers():
    with pytest.raises(PlanError, match="--pp"):
        balance([1.0, 2.0], 3)


def test_parse_stages():
    assert parse_stages("5,9", 12, 3) == [(0, 5), (5, 9), (9, 12)]
    assert parse_stages(" 5 , 9 ", 12, 3) == [(0, 5), (5, 9), (9, 12)]
    assert parse_stages("1", 2, 2) == [(0, 1), (1, 2)]
    assert parse_stages("", 12, 1) == [(0, 12)]


@pytest.mark.parametrize("spec, layers, stages, match", [
    ("5", 12, 3, "--pp"),          # too few cut points
    ("3,5,9", 12, 3, "--pp"),      # too many
    ("9,5", 12, 3, "--stages"),    # decreasing
    ("5,5", 12, 3, "--stages"),    # empty stage
    ("0,5", 12, 3, "--stages"),    # empty first stage
    ("5,12", 12, 3, "--stages"),   # empty last stage
    ("a,b", 12, 3, "--stages"),    # not integers
])
def test_parse_stages_errors(spec, layers, stages, match):
    with pytest.raises(PlanError, match=match):
        parse_stages(spec, layers, stages)


def test_sharded_dropout_shards_make_up_one_full_mask():
    from rayconv.parallel.filter_split.layers import ShardedDropout

    x = torch.ones(4, 6, 3, 3)
    cpu = torch.device("cpu")
    whole = ShardedDropout(0.5, [6], 0)
    whole.reseed(123, cpu)
    want = whole(x)
    parts = []
    for index in (0, 1):
        d = ShardedDropout(0.5, [3, 3], index)
        d.reseed(123, cpu)
        parts.append(d(x[:, 3 * index:3 * index + 3]))
    assert torch.equal(torch.cat(parts, dim=1), want)
    assert not torch.equal(parts[0], parts[1])          # the shards do not repeat one mask
    assert set(want.unique().tolist()) == {0.0, 2.0}    # inverted dropout scaling
    d.reseed(124, cpu)
    assert not torch.equal(d(x[:, 3:]), parts[1])       # a new step draws new masks
    assert torch.equal(d.eval()(x[:, 3:]), x[:, 3:])


def test_config_file_types_are_checked(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"dp": "2"}))
    with pytest.raises(ConfigError, match="dp = '2' has the wrong type: --dp takes int"):
        parse_args(["--config", str(path)])
    path.write_text(json.dumps({"stages": [5, 9]}))
    with pytest.raises(ConfigError, match="--stages takes str"):
        parse_args(["--config", str(path)])
    path.write_text(json.dumps({"lr": 1, "progress": False, "dp": None}))   # an int is a fine float
    assert parse_args(["--config", str(path)]).lr == 1


def test_config_file_of_a_resumed_run_starts_a_new_run(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"steps": 4, "out": "runs/r1", "resume": "runs/r1", "address": "10.0.0.5:6379"}))
    cfg = parse_args(["--config", str(path)])
    assert (cfg.steps, cfg.out, cfg.resume, cfg.address) == (4, None, None, None)


# ---------------------------------------------------------------------- compiled segments, gradient buckets
def test_segments_end_at_the_bucket_size_and_keep_exchanges_eager():
    from rayconv.parallel.filter_split.exchanges import Gather
    from rayconv.parallel.part import segments

    lin = [nn.Linear(16, 16) for _ in range(5)]  # 272 parameters, 1088 bytes each
    gather = Gather(1, [8, 8], 0, None, False)
    runs = segments([lin[0], lin[1], gather, lin[2], lin[3], lin[4]], max_bytes=2 * 1088)
    assert [(c, len(ms)) for c, ms in runs] == [(True, 2), (False, 1), (True, 2), (True, 1)]
    assert runs[1][1][0] is gather
    assert [(c, len(ms)) for c, ms in segments(lin, None)] == [(True, 5)]


def test_old_boolean_compile_setting_still_reads(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"compile": True}))
    assert parse_args(["--config", str(path)]).compile == "on"
    path.write_text(json.dumps({"compile": False}))
    assert parse_args(["--config", str(path)]).compile == "off"
    with pytest.raises(SystemExit):
        parse_args(["--compile", "maybe"])


def test_cuda_graphs_setting_is_checked():
    assert parse_args(["--cuda-graphs", "off"]).cuda_graphs == "off"
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graphs", "maybe"])
    with pytest.raises(ConfigError, match="--cuda-graphs"):
        Config(cuda_graphs="yes").validate()
    Config(cuda_graphs="on", compile="off").validate()  # graphs capture eager steps too


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_capturable_sgd_equals_torch_sgd(dtype):
    """The update a CUDA graph step replays (learning rate read from a device tensor) is torch.optim.SGD's,
    over several steps with momentum, weight decay and a changing learning rate."""
    from rayconv.actor.cuda_graph import sgd_step

    torch.manual_seed(0)
    ref = [nn.Parameter(torch.randn(5, 3, dtype=dtype)), nn.Parameter(torch.randn(3, dtype=dtype))]
    mine = [nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=5e-4)
    opt_mine = torch.optim.SGD(mine, lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_t = {dtype: torch.tensor(0.0, dtype=dtype)}
    for step, lr in enumerate([0.1, 0.05, 0.02, 0.07]):
        grads = [torch.randn_like(p) for p in ref]
        for p, q, g in zip(ref, mine, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ref.param_groups[0]["lr"] = lr
        opt_ref.step()
        lr_t[dtype].fill_(lr)
        sgd_step(opt_mine, lr_t)
        for p, q in zip(ref, mine):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14)
            assert torch.equal(opt_mine.state[q]["momentum_buffer"], opt_ref.state[p]["momentum_buffer"])
    # Its state is torch.optim.SGD's: a checkpoint of one loads into the other.
    opt_ref.load_state_dict(opt_mine.state_dict())
    with pytest.raises(ValueError, match="plain SGD"):
        sgd_step(torch.optim.SGD(mine, lr=0.1, momentum=0.9, nesterov=True), lr_t)


def test_synthetic_images_are_made_in_the_dtype_asked_for():
    src = SyntheticSource(num_classes=10, image_size=8, train_size=32, seed=0)
    idx = np.arange(4)
    x32, x16 = src.images("train", idx, torch.device("cpu")), src.images("train", idx, torch.device("cpu"),
                                                                           dtype=torch.bfloat16)
    assert x32.dtype == torch.float32 and x16.dtype == torch.bfloat16 and x16.shape == x32.shape == (4, 3, 8, 8)
    assert torch.equal(src.images("train", idx, torch.device("cpu"), dtype=torch.bfloat16), x16)  # same seed


def test_gradient_sync_buckets_keep_channels_last_gradients(tmp_path):
    """GradientSync in a real one-rank gloo process group: the sum over one replica is the gradient
    itself, whatever the parameter's memory layout; a parameter without a gradient gets zeros."""
    import torch.distributed as dist

    from rayconv.parallel.data_parallel import GradientSync

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    sync = None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(16, 3))
        model.to(memory_format=torch.channels_last)
        unused = nn.Parameter(torch.ones(5))
        params = [*model.parameters(), unused]
        sync = GradientSync(params, dist.new_group([0]), bucket_mb=0.001, first_bucket_mb=0.0001)
        assert len(sync.buckets) > 2
        x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
        model(x).sum().backward()
        want = {id(p): p.grad.clone() for p in model.parameters()}
        strides = {id(p): p.grad.stride() for p in model.parameters()}
        model.zero_grad(set_to_none=True)
        sync.arm()
        model(x).sum().backward()
        sync.finish()
        for p in model.parameters():
            torch.testing.assert_close(p.grad, want[id(p)], rtol=0, atol=0)
            assert p.grad.stride() == strides[id(p)]
        assert torch.equal(unused.grad, torch.zeros(5))
    finally:
        if sync is not None:
            sync.close()  # else its hooks keep the gloo group (and its threads) alive until exit
        dist.destroy_process_group()


def test_visible_index_maps_ray_gpu_ids_to_torch_indices():
    from rayconv.actor.worker import visible_index

    assert visible_index("3", "") == 3                 # every GPU visible: ids are indices
    assert visible_index("3", "2,3") == 1              # node started with CUDA_VISIBLE_DEVICES=2,3
    assert visible_index(2, " 2 , 3") == 0
    assert visible_index("GPU-abc", "GPU-xyz,GPU-abc") == 1  # UUIDs as ids


def test_atomic_write_gives_files_the_mode_a_plain_open_would(tmp_path):
    import stat

    from rayconv import files as metrics

    metrics.atomic_write(tmp_path / "a.txt", lambda tmp: open(tmp, "w").write("x"))
    mode = stat.S_IMODE((tmp_path / "a.txt").stat().st_mode)
    assert mode == 0o666 & ~metrics._UMASK, oct(mode)  # not mkstemp's 0600
    if not metrics._UMASK & 0o044:
        assert mode & 0o044, oct(mode)  # readable by others, as results shared on a cluster need


def test_image_suffixes_are_torchvisions():
    """rayconv.data writes torchvision's ImageFolder suffixes out (importing torchvision costs each
    actor seconds); they must stay the same set."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from rayconv.data.folders import IMAGE_SUFFIXES

    assert sorted(IMAGE_SUFFIXES) == sorted(IMG_EXTENSIONS)


def test_a_run_of_rayconvs_own_model_does_not_import_torchvision():
    """An actor of a convnet run on the digits imports the worker, builds its part and reads data
    without torchvision (whose import pulls in torch._dynamo) or scikit-learn: seconds per actor."""
    code = ("import sys; from rayconv.actor import worker; from rayconv.driver import job; from rayconv.data import registry as data; from rayconv import models; "
            "from rayconv.config import Config; cfg = Config(model='convnet').validate(); "
            "src = data.make_source(cfg); models.to_layers(models.run_model(cfg, src)); "
            "print('torchvision' in sys.modules, 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False", out.stderr[-2000:]


def test_digits_read_without_scikit_learn_equal_load_digits():
    from sklearn.datasets import load_digits

    images, targets = digits_arrays()
    d = load_digits()
    assert images.shape == (1797, 8, 8) and np.array_equal(images, d.images)
    assert np.array_equal(targets, d.target)

"""GPU checks (run on the lent GPU machine: ``pytest -m gpu``): NCCL inside the actors, each layout
equal to single-device SGD in float64, and short bf16 runs of AlexNet under filter split and pipeline."""

from __future__ import annotations

import pytest
import torch
from conftest import local_ray

from support.helpers import assert_same_state, recalibrated, reference_microbatch_sgd, reference_sgd
from rayconv.config import Config
from rayconv.driver.job import train_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")]
# (on a machine of one GPU, the tests of one GPU still run)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="module")
def gpu_cluster():
    yield from local_ray(8, num_gpus=torch.cuda.device_count(), log_to_driver=True)


# On GPUs every step after two warm-up steps replays one captured CUDA graph (--cuda-graphs auto);
# the "-eager" cases run every step eagerly.
LAYOUTS = {
    "dp2": dict(dp=2),                                        # actors see all GPUs of the node (default)
    "dp2-eager": dict(dp=2, cuda_graphs="off"),
    "dp2-one-gpu-visible": dict(dp=2, all_gpus_visible=False),
    "dp2-compiled": dict(dp=2, compile="on", bucket_mb=0.02),  # compiled segments between all-reduces
    "1gpu-compiled": dict(compile="on"),
    "pp2-balanced-by-time": dict(pp=2, num_microbatches=2, balance="time"),
    "fs2": dict(fs=2),
    "fs2-eager": dict(fs=2, cuda_graphs="off"),
    "fs2-overlapped": dict(fs=2, exchange_chunks=3),  # each gather in 3 pieces, captured with the step
    "fs2-overlapped-eager": dict(fs=2, exchange_chunks=3, cuda_graphs="off"),
    "pp2-1f1b": dict(pp=2, num_microbatches=2),
    "pp2-1f1b-eager": dict(pp=2, num_microbatches=2, cuda_graphs="off"),
    "pp2-one-microbatch": dict(pp=2),  # the default --num-microbatches 1: its round batch is split to mirror
    "pp2-gpipe-4": dict(pp=2, num_microbatches=4, schedule="gpipe"),
    "pp2-gpipe-4-eager": dict(pp=2, num_microbatches=4, schedule="gpipe", cuda_graphs="off"),
    "pp2-interleaved-v2-m4": dict(pp=2, num_microbatches=4, virtual_stages=2),
    "pp2-interleaved-v2-m4-eager": dict(pp=2, num_microbatches=4, virtual_stages=2, cuda_graphs="off"),
    "plan-dp2": dict(dp=2, plan="krizhevsky2014"),
    "plan-dp2-eager": dict(dp=2, plan="krizhevsky2014", cuda_graphs="off"),
}

def _world(layout: dict) -> int:
    return layout.get("dp", 1) * layout.get("pp", 1) * layout.get("fs", 1)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[two_gpus] if _world(kw) > 1 else [])
                                  for n, kw in LAYOUTS.items()])
def test_gpu_layout_matches_single_device(gpu_cluster, tmp_path, name):
    # (stages cut by FLOPs unless the layout says: timing the layers first costs a GPU task per test)
    kw = dict(model="convnet", data="digits", dp=1, global_batch_size=96, steps=5, precision="fp64",
              device="cuda", progress=False, out=str(tmp_path / name), balance="flops")
    kw.update(LAYOUTS[name])
    cfg = Config(**kw).validate()
    summary = train_run(cfg, log=print)
    assert all(a["device"].startswith("cuda") for a in summary["actors"])
    got = torch.load(tmp_path / name / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, 5), atol=1e-8)


@pytest.mark.parametrize("layout", [dict(num_microbatches=4),
                                    pytest.param(dict(pp=2, num_microbatches=4), marks=two_gpus)])
def test_cuda_graph_defers_batchnorm_statistics(gpu_cluster, tmp_path, layout):
    """Batch norm under micro-batches in replayed CUDA graphs: running statistics advance once per step
    from the whole batch (tests/actors/test_batchnorm.py says what the reference claims)."""
    cfg = Config(model="convnet_bn", data="digits", dp=1, global_batch_size=96, steps=5, precision="fp64",
                 device="cuda", progress=False, out=str(tmp_path / "bn"), balance="flops",
                 **layout).validate()
    summary = train_run(cfg, log=print)
    assert all(a["cuda_graphs"] for a in summary["actors"])
    got = torch.load(tmp_path / "bn" / "model.pt", weights_only=True)
    assert [int(got[k]) for k in got if k.endswith("num_batches_tracked")] == [5] * 3
    assert_same_state(got, reference_microbatch_sgd(cfg, 5)[0], atol=1e-8)


@pytest.mark.parametrize("layout", [dict(), dict(num_microbatches=4),
                                    pytest.param(dict(pp=2, num_microbatches=2), marks=two_gpus)])
def test_precise_bn_between_replayed_steps(gpu_cluster, tmp_path, layout):
    """--precise-bn-batches between steps that replay a CUDA graph (an evaluation after each, the moving
    average on): the weights equal a run's without it, and the last evaluation's statistics and test loss
    equal one device's recomputed over the same batches (tests/actors/test_precise_bn.py)."""
    kw = dict(model="convnet_bn", data="digits", dp=1, global_batch_size=96, steps=5, eval_every=1,
              precision="fp64", device="cuda", progress=False, balance="flops", model_ema=True,
              model_ema_steps=1, **layout)
    states = {}
    for n in (0, 3):
        cfg = Config(**kw, precise_bn_batches=n, out=str(tmp_path / str(n))).validate()
        summary = train_run(cfg, log=print)
        assert all(a["cuda_graphs"] for a in summary["actors"])
        states[n] = torch.load(tmp_path / str(n) / "model.pt", weights_only=True)
    weights = [k for k in states[0] if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert_same_state({k: states[3][k] for k in weights}, {k: states[0][k] for k in weights}, atol=1e-10)
    want, loss, _ = recalibrated(cfg, reference_microbatch_sgd(cfg, 5)[0], range(5, 8))
    assert_same_state(states[3], want, atol=1e-8)
    assert abs(summary["test_loss"] - loss) < 1e-8


def test_a_kept_gpu_actor_trains_the_next_run_as_a_new_one(gpu_cluster, tmp_path):
    """--keep-actors-s on a GPU: the second run takes the first's actor (its model, data, compiled code
    and captured graph dropped, device memory freed) and trains compiled, replaying a new CUDA graph, to
    single-device SGD as the first run did."""
    seen, states = [], {}
    for name in ("a", "b"):
        cfg = Config(model="convnet", data="digits", dp=1, global_batch_size=96, steps=5, precision="fp64",
                     device="cuda", compile="on", progress=False, out=str(tmp_path / name),
                     balance="flops").validate()
        summary = train_run(cfg, log=print, on_step=lambda g, step: step or seen.append((g.info[0]["pid"],
                                                                                         g.reused)))
        assert all(a["cuda_graphs"] for a in summary["actors"])
        states[name] = torch.load(tmp_path / name / "model.pt", weights_only=True)
    assert seen[1] == (seen[0][0], True), seen
    want = reference_sgd(cfg, 5)
    assert_same_state(states["a"], want, atol=1e-8)
    assert_same_state(states["b"], want, atol=1e-8)


@two_gpus
def test_cuda_graph_replays_dropout_and_learning_rate_as_eager(gpu_cluster, tmp_path):
    """AlexNet under the per-layer plan (dropout on the gathered batch from the default generator, sliced
    dropout from a generator shared by the split) with a cosine learning rate: replayed steps equal eager
    steps. A replay that kept the capture's masks or learning rate would differ."""
    kw = dict(model="alexnet", data="synthetic", image_size=64, synthetic_samples=512, global_batch_size=64,
              steps=5, precision="fp64", device="cuda", dp=2, plan="krizhevsky2014", progress=False)
    states = {}
    for graphs in ("off", "on"):
        cfg = Config(**kw, cuda_graphs=graphs, out=str(tmp_path / graphs)).validate()
        train_run(cfg, log=print)
        states[graphs] = torch.load(tmp_path / graphs / "model.pt", weights_only=True)
    assert_same_state(states["on"], states["off"], atol=1e-10)


@two_gpus
@pytest.mark.parametrize("layout", [dict(fs=2), dict(pp=2, num_microbatches=4),
                                    dict(dp=2, plan="krizhevsky2014"), dict(fs=2, compile="on"),
                                    dict(dp=2, plan="krizhevsky2014", compile="on")])
def test_alexnet_bf16_short_training(gpu_cluster, tmp_path, layout):
    kw = dict(model="alexnet", data="synthetic", image_size=224, synthetic_samples=2048,
              global_batch_size=256, steps=6, precision="bf16", device="cuda", dp=1, progress=False,
              out=str(tmp_path / "alex"), lr=0.01)
    kw.update(layout)
    cfg = Config(**kw)
    summary = train_run(cfg.validate(), log=print)
    assert summary["final_train_loss"] > 0 and summary["steps"] == 6
    print("ALEXNET", layout, f"{summary['images_per_s']:.0f} images/s",
          [round(a["peak_gib"], 2) for a in summary["actors"]], "GiB peak")


def test_captured_sgd_update_equals_torch_sgd_on_gpu():
    """The fused update inside a CUDA graph, replayed with new gradients and learning rates, follows
    torch.optim.SGD step for step (float32: the fused kernel's path)."""
    from torch import nn

    from rayconv.actor.cuda_graph import sgd_step

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    ref = [nn.Parameter(torch.randn(300, 70, device=dev)), nn.Parameter(torch.randn(70, device=dev))]
    mine = [nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=5e-4)
    opt_mine = torch.optim.SGD(mine, lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_t = {torch.float32: torch.tensor(0.1, device=dev)}
    grads = [torch.randn_like(p) for p in ref]  # static: the graph reads them where they are
    for p, q, g in zip(ref, mine, grads):
        p.grad, q.grad = g.clone(), g
    opt_ref.step()
    sgd_step(opt_mine, lr_t)  # first step, eager: makes the momentum buffers
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.graph(graph, stream=stream):
        sgd_step(opt_mine, lr_t)
    for lr in (0.05, 0.02, 0.07):
        new = [torch.randn_like(p) for p in ref]
        for g, n in zip(grads, new):
            g.copy_(n)
        lr_t[torch.float32].fill_(lr)
        graph.replay()
        for p, n in zip(ref, new):
            p.grad = n.clone()
        opt_ref.param_groups[0]["lr"] = lr
        opt_ref.step()
    torch.cuda.synchronize(dev)
    for p, q in zip(ref, mine):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)


def test_step_graph_captures_the_partial_batch_as_well_and_replays_as_eager():
    """Epochs of two full batches (64) and a partial one (24) through ``StepGraph``: the full shape is
    captured after two warm-up steps, the partial one after its first (eager) step, each in a graph of
    its own, and replayed from then on; parameters, momentum and batch-norm statistics equal the same
    steps run eagerly (float64). A replay that read the other shape's inputs, or a shape left eager,
    would fail."""
    from torch import nn
    from torch.nn import functional as F

    from rayconv.actor.cuda_graph import StepGraph, sgd_step

    dev = torch.device("cuda", 0)

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).to(dev, torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        return model, opt, {torch.float64: torch.tensor(0.1, device=dev, dtype=torch.float64)}

    def one(model, opt, lr_t, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        sgd_step(opt, lr_t)
        return loss.detach()

    g = torch.Generator(device=dev).manual_seed(1)
    data = [(torch.randn(n, 3, 8, 8, device=dev, dtype=torch.float64, generator=g),
             torch.randint(0, 5, (n,), device=dev, generator=g)) for n in [64, 64, 24] * 4]
    eager = make()
    for x, y in data:
        one(*eager, x, y)
        eager[1].zero_grad(set_to_none=True)
    graphed, graph, losses = make(), StepGraph(dev, (64,)), []
    for x, y in data:
        key = (len(x),)
        if graph.will_replay(key):
            x, y = graph.buffer("images", x), graph.buffer("labels", y)
        losses.append(graph.run(key, lambda: one(*graphed, x, y)).clone())
        if not graph.replayed:
            graphed[1].zero_grad(set_to_none=True)
    torch.cuda.synchronize(dev)
    assert set(graph.graphs) == {(64,), (24,)}
    assert_same_state(graphed[0].state_dict(), eager[0].state_dict(), atol=1e-12)
    for p, q in zip(graphed[0].parameters(), eager[0].parameters()):
        torch.testing.assert_close(graphed[1].state[p]["momentum_buffer"],
                                   eager[1].state[q]["momentum_buffer"], rtol=0, atol=1e-12)
    assert len({round(float(v), 12) for v in losses}) == len(losses)   # (each step's own loss came back)


def test_a_run_whose_epochs_end_in_a_partial_batch_replays_it_and_equals_single_device_sgd(
    gpu_cluster, tmp_path
):
    """Digits (1,438 train images) in global batches of 96: 15 steps an epoch, the last of 94; three
    epochs with CUDA graphs (the partial step eager, then captured, then replayed) equal single-device SGD."""
    kw = dict(model="convnet", data="digits", global_batch_size=96, steps=45, precision="fp64", device="cuda",
              cuda_graphs="on", progress=False, out=str(tmp_path / "run"))
    cfg = Config(**kw).validate()
    summary = train_run(cfg, log=print)
    assert all(a["cuda_graphs"] for a in summary["actors"])
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, 45), atol=1e-8)


@two_gpus
def test_crossing_sends_of_1f1b_complete_eagerly_and_in_a_graph():
    """Two ranks each send 64 MB to the other while receiving (1F1B's steady state) through
    ``comm.exchange``: one NCCL group, so it completes, eagerly and replayed from a CUDA graph, and
    delivers the peer's data. (Posted one by one, such sends wait for receives queued behind the
    other rank's send: ``tests/gpu/nccl_crossing.py --unpaired``, which failed on the H200s.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(root / "tests" / "gpu" / "nccl_crossing.py")
    ], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("PAIRED-OK") == 2, r.stdout


def test_overlapped_gather_on_nccl_eager_and_captured(tmp_path):
    """filter_split.overlapped_gather on a one-rank NCCL group (one GPU): the pieces' asynchronous
    all-gathers and reduce-scatters, waited on the compute stream, give the plain layer's output and
    gradients, eagerly and replayed from a CUDA graph (float64)."""
    import copy
    import os

    import torch.distributed as dist
    from torch import nn

    from rayconv.parallel.filter_split.exchanges import ExchangeSpec, overlapped_gather

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        group = dist.new_group([0])
        torch.manual_seed(0)
        conv = nn.Conv2d(6, 4, 3, padding=1).double().cuda()
        x0 = torch.randn(7, 6, 5, 5, dtype=torch.float64, device="cuda")
        gy = torch.randn(7, 4, 5, 5, dtype=torch.float64, device="cuda")
        spec = ExchangeSpec(1, [6], 0, group, 3)

        x_ref = x0.clone().requires_grad_()
        y_ref = conv(x_ref)
        y_ref.backward(gy)
        want = (y_ref.detach(), x_ref.grad.clone(), conv.weight.grad.clone())

        x = x0.clone().requires_grad_()
        conv.zero_grad()
        y = overlapped_gather(x, spec, conv)
        y.backward(gy)
        for got, ref in zip((y.detach(), x.grad, conv.weight.grad), want):
            assert torch.allclose(got, ref, atol=1e-12)
        del y, y_ref

        # Captured, as a rayconv step is: a fresh copy of the layer (no autograd node of the eager passes
        # above lives on), warm-up passes and the capture on a side stream, then a replay.
        captured = copy.deepcopy(conv)
        captured.zero_grad(set_to_none=True)
        static_x = x0.clone().requires_grad_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                static_x.grad = None
                captured.zero_grad(set_to_none=True)
                overlapped_gather(static_x, spec, captured).backward(gy)
        torch.cuda.current_stream().wait_stream(stream)
        static_x.grad = None
        captured.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            out = overlapped_gather(static_x, spec, captured)
            out.backward(gy)
        static_x.grad.zero_()
        captured.weight.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip((out.detach(), static_x.grad, captured.weight.grad), want):
            assert torch.allclose(got, ref, atol=1e-12)
    finally:
        dist.destroy_process_group()


def test_the_actors_cuda_library_set_up_runs_and_draws_no_random_numbers():
    """An actor's warm-up sets up cuDNN and cuBLAS on its own thread before ``build``
    (``build.set_up_cuda_libraries``): it runs through (its failures are swallowed, so a silent one would only
    show as a slower first step) and leaves the CPU's and the GPU's random streams as they were, so the
    model built from the seed afterwards is the one every layout builds."""
    import threading

    from rayconv.actor.build import set_up_cuda_libraries

    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state()
    for precision in ("bf16", "fp32"):
        ran = []
        thread = threading.Thread(target=lambda: ran.append(set_up_cuda_libraries(torch.device("cuda", 0),
                                                                                  precision)))
        thread.start()
        thread.join()
        assert ran == [True], precision
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(), gpu)

"""Batch norm under micro-batches (deferred batch norm, torchgpipe section 3.4): what equals what.

A replica's batch run as M micro-batches is normalised micro-batch by micro-batch in the forward pass
(which no layout can change), but its running statistics advance once per step, from the replica's
whole batch. So every layout below must equal, in float64, the single-device reference
``helpers.reference_microbatch_sgd``: the same micro-batches run one after another with gradient
accumulation (each normalised by its own statistics: the weights), and once per step the running statistics
moved by torch's own ``nn.BatchNorm`` arithmetic on the concatenation of dp replica 0's micro-batches (running
statistics follow replica 0, as in DDP), ``num_batches_tracked`` + 1.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from support.helpers import assert_same_state, reference_microbatch_sgd, sgd_config, slow_among
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.parallel.batchnorm import DeferredBatchNorm, defer_batchnorm
from rayconv.run import main

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 3  # global batch 96 of the 1438 digits


LAYOUTS = {
    "dp2-m2": dict(dp=2, num_microbatches=2),               # micro-batches without a pipeline
    "pp2-gpipe-m4": dict(pp=2, schedule="gpipe", num_microbatches=4),
    "pp2-interleaved-v2-m4": dict(pp=2, virtual_stages=2, num_microbatches=4),
    "plan-dp2-m2": dict(dp=2, plan="krizhevsky2014", num_microbatches=2),  # batch norm in the conv layers' dp
}


def bn_config(tmp_path, name, **kw) -> Config:
    return sgd_config(tmp_path, name, **{"model": "convnet_bn", "steps": STEPS, "eval_every": STEPS, **kw})


@pytest.mark.parametrize("name", slow_among(LAYOUTS, {"pp2-gpipe-m4", "pp2-interleaved-v2-m4"}))
def test_running_statistics_advance_once_per_step(ray_cluster, tmp_path, name):
    """Weights, running statistics and num_batches_tracked equal the micro-batch reference; the
    evaluation (eval mode) uses those running statistics."""
    cfg = bn_config(tmp_path, name, **LAYOUTS[name])
    summary = train_run(cfg, log=lambda *_: None)
    got = torch.load(tmp_path / name / "model.pt", weights_only=True)
    want, test_loss = reference_microbatch_sgd(cfg, STEPS)
    assert [int(got[k]) for k in got if k.endswith("num_batches_tracked")] == [STEPS] * 3
    assert_same_state(got, want, atol=1e-10)
    assert abs(summary["test_loss"] - test_loss) < 1e-10


def test_resume_with_micro_batches_is_exact(ray_cluster, tmp_path):
    """A step, stop, resume, a step: the accumulators are per-step scratch, not state (a checkpoint
    holds none), so the resumed run still equals the micro-batch reference."""
    kw = dict(pp=2, num_microbatches=2, steps=2, eval_every=2, checkpoint_every=1, loader_workers=0)
    stopped = tmp_path / "stopped"

    class Stop(Exception):
        pass

    def crash(actor_group, step):
        raise Stop()

    with pytest.raises(Stop):
        train_run(bn_config(tmp_path, "stopped", **kw), log=lambda *_: None, on_step=crash)
    assert main(["--resume", str(stopped)]) == 0
    got = torch.load(stopped / "model.pt", weights_only=True)
    assert [int(got[k]) for k in got if k.endswith("num_batches_tracked")] == [2] * 3
    assert_same_state(got, reference_microbatch_sgd(bn_config(tmp_path, "ref", **kw), 2)[0], atol=1e-10)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(12, 3, 4, 4), (12, 3), (12, 3, 5)])
def test_deferred_layer_equals_batchnorm_on_the_whole_batch(momentum, shape):
    """One layer, no Ray: micro-batch outputs and input gradients as nn.BatchNorm gives per micro-batch;
    running statistics after 3 steps as nn.BatchNorm gives on each step's whole batch (momentum=None:
    the cumulative average); eval mode uses them."""
    torch.manual_seed(0)
    kind = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
    ref = kind(3, momentum=momentum).double()
    layer = defer_batchnorm(copy.deepcopy(ref))
    assert isinstance(layer, DeferredBatchNorm) and layer.state_dict().keys() == ref.state_dict().keys()
    for _ in range(3):
        x = (torch.randn(*shape, dtype=torch.float64) * 3 + 1).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        outs = [layer(c) for c in x.split([5, 4, 3])]
        layer.commit()
        ref.track_running_stats = False
        ref_outs = [ref(c) for c in x_ref.split([5, 4, 3])]
        ref.track_running_stats = True
        with torch.no_grad():
            ref(x_ref)
        for o, r in zip(outs, ref_outs):
            torch.testing.assert_close(o, r, rtol=0, atol=1e-14)
        g = torch.randn(*shape, dtype=torch.float64)
        torch.autograd.backward(outs, list(g.split([5, 4, 3])))
        torch.autograd.backward(ref_outs, list(g.split([5, 4, 3])))
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    assert_same_state(layer.state_dict(), ref.state_dict(), atol=1e-13)
    assert int(layer.num_batches_tracked) == 3
    x = torch.randn(*shape, dtype=torch.float64)
    torch.testing.assert_close(layer.eval()(x), ref.eval()(x), rtol=0, atol=1e-13)


def test_empty_micro_batches_add_nothing():
    """An empty micro-batch adds nothing; a step of empty micro-batches only counts, as nn.BatchNorm
    does on an empty batch."""
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(3).double()
    layer = defer_batchnorm(copy.deepcopy(ref))
    x = torch.randn(8, 3, 4, 4, dtype=torch.float64)
    for c in x.split([5, 0, 3]):
        layer(c)
    layer.commit()
    ref(x)
    layer(x[:0])
    layer.commit()
    ref(x[:0])
    assert_same_state(layer.state_dict(), ref.state_dict(), atol=1e-14)
    assert int(layer.num_batches_tracked) == 2


def test_layers_without_running_statistics_stay_as_they_are():
    seq = nn.Sequential(nn.Conv2d(1, 3, 1), nn.BatchNorm2d(3, track_running_stats=False), nn.BatchNorm2d(3))
    out = defer_batchnorm(seq)
    assert out is seq and type(seq[1]) is nn.BatchNorm2d and isinstance(seq[2], DeferredBatchNorm)
    assert seq[2].running_mean is not None and not any("acc" in k for k in seq.state_dict())

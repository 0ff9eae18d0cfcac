"""Precise BN: batch-norm running statistics recomputed before an evaluation (``--precise-bn-batches N``).

During training each batch norm's running statistics are an exponential average (momentum 0.1) of
batch statistics taken under weights that have since moved; when the weights move fast the average
lags them, and the evaluation, which normalises by it, suffers. Wu and Johnson 2021 ("Rethinking
'Batch' in BatchNorm", section 3) recompute the statistics under the weights being evaluated: the
running mean and variance become the plain average of the per-batch means and unbiased variances over
N training batches, forward in train mode without gradients (``torch.optim.swa_utils.update_bn``;
pycls's and detectron2's PreciseBN).

The N batches are the training order's next ones, those of global steps ``next_step .. next_step +
N - 1`` (across an epoch's end as the order goes on; after the last step, the order's continuation),
each replica's share as the step will read it: augmented as in its epoch, without mixup or cutmix
(``Batches.calibration``). Reading them consumes nothing and changes nothing: a sample's image depends
on (seed, epoch, index) alone, dropout is seeded per step (``step.seed``, each batch with its own
step's seeds, which that step sets again), and the weights, the optimizer and the training order are
untouched. So every training step is the same with or without it; only the running statistics change,
and they stay (the checkpoints and ``model.pt`` hold the statistics the evaluation used);
``num_batches_tracked`` keeps counting training steps.

Every layout: the forward runs through the stage programs of ``forward_only`` with the run's
micro-batches (pipeline stages exchange activations as in an evaluation; filter-split slices and the
per-layer plan's batch gather exchange as in training). Each replica averages over its own share (each
micro-batch normalised by its own statistics, a batch's statistics those of the share, as a training
step's: ``batchnorm.DeferredBatchNorm``); then, as after every step, the statistics follow dp replica
0 (``--sync-batchnorm``: over the global batch, every replica alike). With ``--model-ema`` the moving
average's statistics are recomputed the same way under the average's weights and written back into
the average (its weights untouched), so ``ema_test_accuracy`` and ``model_ema.pt`` use them too.
"""

from __future__ import annotations

import torch

from rayconv.actor.build import ActorState
from rayconv.actor.state import weights
from rayconv.actor.step import seed
from rayconv.parallel.batchnorm import averaged_statistics, commit_batchnorm, tracking_batchnorms
from rayconv.parallel.data_parallel import broadcast_modules
from rayconv.parallel.pipeline.p2p import p2p_posts
from rayconv.parallel.pipeline.schedules import forward_only


def recalibrate(a: ActorState, next_step: int, ema: bool) -> int:
    """Recompute this part's batch-norm running statistics over the ``a.cfg.precise_bn_batches``
    training batches from global step ``next_step`` on (module docstring); ``ema``: those of the moving
    average too (RuntimeError without --model-ema). Collective over the mesh, as a step is: every actor
    calls it with the same arguments. Returns the batches averaged (those where some replica has no
    sample are skipped); 0 for a part without batch norm."""
    n = _recalibrate_part(a, next_step)
    if ema:
        with weights(a, True):
            _recalibrate_part(a, next_step)
            tensors = a.recipe.ema.tensors
            for k, v in a.part.state_dict().items():
                if k.endswith(("running_mean", "running_var")):
                    tensors[k].copy_(v)
    return n


def _recalibrate_part(a: ActorState, next_step: int) -> int:
    """``recalibrate`` of the weights the part holds now."""
    layers = tracking_batchnorms(a.part)
    steps = range(next_step, next_step + a.cfg.precise_bn_batches)
    n_mb = a.routing.schedule.num_microbatches
    sched = forward_only(a.mesh.pp, n_mb, a.routing.schedule.virtual_stages)
    program, posts = sched.programs[a.coord.pp], p2p_posts(sched, a.coord.pp)
    a.part.train()
    a.train_mode = True
    seen = 0
    with averaged_statistics(layers), torch.no_grad():
        for step, mb in a.batches.calibration(steps, n_mb):
            seed(a, step)
            a.runner.run(program, posts, mb.inputs, lambda m, out: out, mb.sizes, lambda: None,
                         train=False, before_forward=mb.before_forward)
            commit_batchnorm(a.parallel.deferred_bn)   # (one batch: the share's micro-batches together)
            seen += 1
    if a.parallel.has_buffers and not a.cfg.sync_batchnorm:
        broadcast_modules(a.parallel.replicated, a.groups.ranks["dp"][0], a.groups.axis["dp"],
                          buffers_only=True)
    return seen if layers else 0

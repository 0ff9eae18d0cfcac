"""A batch's way from its source to the step: which samples this actor reads, in which micro-batches,
and what it announces to the loader ahead of time.

Which samples a step sees depends only on (seed, epoch, step) and the replica (``data.source.Sharding``),
so every layout equals one device. Each replica's batch is cut into micro-batches (``mesh.split_slices``).
The first pipeline stage reads images; the last reads labels, except under Krizhevsky 2014's
per-layer plan, where the FC layers see the whole gathered batch, so every actor reads the labels of
micro-batch m of every replica.

Mixup and cutmix (``--mixup-alpha``, ``--cutmix-alpha``; ``rayconv/recipe/mix.py``): one draw per
global batch from (seed, step). The first stage reads, with its own samples and in the same
``images`` call, the samples at its samples' partner positions of the global batch (which may belong
to other replicas); a source's augmentation of a sample depends on (seed, epoch, index) alone, so a
partner is seen exactly as its own replica sees it. The images are mixed before the step; the stage
that computes the loss mixes the one-hot labels the same way into soft targets (N, K). Every layout
(replicas, micro-batches, filter-split slices, which all read the same images) thus trains on the
same mixed global batch.

The prefetch protocol (``Source.prefetch``): the first stage announces, before reading them, the
index arrays it will ask ``images`` for, in order -- for training the next epoch once the epoch's
last step is under way (``announce_next``: the next epoch's first batches are read and made while the
last step computes and the evaluation runs), the rest of the epoch at an actor's first step (after a
resume) or at an epoch's first step that was not announced ahead, each step's own samples followed
by their partners' when mixing; for evaluation every micro-batch. A source that decodes files starts
decoding them then. ``Batches.announce`` is the one place that announces. A source with a ``stream``
(shards streamed from object storage: ``data/shard_stream.py``) is also told the next epoch's batches
with each epoch's announcement, which order its cache's evictions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from rayconv.actor.cuda_graph import StepGraph
from rayconv.actor.steptime import StepClock
from rayconv.data.source import Sharding, Source, replica_test_indices, to_device, replica_val_indices
from rayconv.mesh import Coord, Mesh, split_slices
from rayconv.parallel.filter_split.exchanges import BatchGather
from rayconv.recipe.mix import MixDraw, draw_mix, mix_images, mix_targets, partner_positions


@dataclass(frozen=True)
class StepMix:
    """One step's mix: ``draw`` (``recipe.mix.MixDraw``) over the global batch ``batch`` (its sample
    indices, (B,)), split over ``dp`` replicas as ``Sharding`` splits it."""

    draw: MixDraw
    batch: np.ndarray
    dp: int

    def partners(self, replica: int) -> np.ndarray:
        """Sample indices of the partners of replica ``replica``'s samples, in its samples' order."""
        sl = split_slices(len(self.batch), self.dp)[replica]
        return self.batch[partner_positions(self.draw, np.arange(sl.start, sl.stop))]


@dataclass
class MicroBatches:
    """One step's micro-batches for this actor: ``sizes[m]`` samples of this replica in micro-batch m;
    ``inputs(m)`` its images ``x_NCHW`` on the device (None off the first stage); ``labels(m)`` its
    labels on the device (soft targets (N, K) under mixup or cutmix; None where no loss is computed);
    ``before_forward(m)``, if any, sets the
    per-layer plan's batch gather to micro-batch m's sizes."""

    sizes: list[int]
    inputs: Callable[[int], Optional[torch.Tensor]]
    labels: Callable[[int], Optional[torch.Tensor]]
    before_forward: Optional[Callable[[int], None]] = None


class Batches:
    """Who reads which micro-batch, for one actor at ``coord`` of ``mesh``; ``mix`` = (mixup alpha,
    cutmix alpha), (0, 0) for neither. ``train`` uses the mix ``train_indices`` drew for its step."""

    def __init__(self, source: Source, sharding: Sharding, mesh: Mesh, coord: Coord, device: torch.device,
                 input_dtype: torch.dtype, batch_gather: Optional[BatchGather],
                 mix: tuple[float, float] = (0.0, 0.0), epochs: Optional[int] = None):
        self.source, self.sharding, self.mesh, self.coord = source, sharding, mesh, coord
        self.device, self.input_dtype = device, input_dtype
        self.is_first, self.is_last = coord.pp == 0, coord.pp == mesh.pp - 1
        self.batch_gather = batch_gather  # (the per-layer plan's: it needs every replica's labels)
        self.first_step = 0  # the first step this actor runs (after a resume, not 0)
        self.epochs = epochs  # the epochs the run trains (None: no end known); none is announced past them
        self.announced: Optional[int] = None  # the epoch whose training batches were announced last
        self.mix_alphas = mix
        self.mix: Optional[StepMix] = None  # the mix of the step train_indices last named
        # soft targets in the parameters' precision (float64 runs stay exact)
        self.target_dtype = torch.float64 if input_dtype == torch.float64 else torch.float32

    # ------------------------------------------------------------------ which samples
    def train_indices(self, step: int) -> tuple[int, list[np.ndarray]]:
        """(epoch, every replica's sample indices) of global step ``step``, and its mix (``self.mix``);
        announces the rest of the epoch to the loader at this actor's first step, and at an epoch's first
        step that ``announce_next`` did not announce."""
        epoch, step_in_epoch = divmod(step, self.sharding.steps_per_epoch)
        if step == self.first_step or (step_in_epoch == 0 and self.announced != epoch):
            self._announce_epoch(epoch, step_in_epoch)
        replica_idx = [self.sharding.replica_batch(epoch, step_in_epoch, r, self.mesh.dp)[0]
                       for r in range(self.mesh.dp)]
        self.mix = self.step_mix(step)
        return epoch, replica_idx

    def announce_next(self, step: int) -> None:
        """After step ``step``'s batch was read and its computation launched: at an epoch's last step,
        announce the next epoch's batches (unless the run ends with this epoch), so that the source reads
        them while this step computes and the evaluation runs."""
        epoch, step_in_epoch = divmod(step, self.sharding.steps_per_epoch)
        if step_in_epoch == self.sharding.steps_per_epoch - 1 and (
            self.epochs is None or epoch + 1 < self.epochs
        ):
            self._announce_epoch(epoch + 1, 0)

    def _announce_epoch(self, epoch: int, step_in_epoch: int) -> None:
        """Announce ``epoch``'s training batches from ``step_in_epoch`` on (first stage only)."""
        if not self.is_first:
            return
        first = epoch * self.sharding.steps_per_epoch
        self.announce("train", epoch, [self._read("train", epoch, s, self.step_mix(first + s))
                                       for s in range(step_in_epoch, self.sharding.steps_per_epoch)])
        self.announced = epoch
        foresee = getattr(self.source, "foresee", None)   # (a streamed set: the next epoch orders its cache)
        streamed = getattr(self.source, "stream", None) is not None
        if streamed and foresee is not None and (self.epochs is None or epoch + 1 < self.epochs):
            steps = self.sharding.steps_per_epoch
            foresee("train", epoch + 1, [self._read("train", epoch + 1, s, self.step_mix(first + steps + s))
                                         for s in range(steps)])

    def step_mix(self, step: int) -> Optional[StepMix]:
        """The mixup/cutmix of global step ``step`` (``recipe.mix.draw_mix`` from (seed, step)), None
        when both alphas are 0."""
        if not any(self.mix_alphas):
            return None
        epoch, step_in_epoch = divmod(step, self.sharding.steps_per_epoch)
        batch = self.sharding.global_batch(epoch, step_in_epoch)
        draw = draw_mix(self.sharding.seed, step, len(batch), *self.mix_alphas,
                        image_size=tuple(self.source.sample_shape[1:]))
        return StepMix(draw, batch, self.mesh.dp)

    def _read(self, split: str, epoch: int, step_in_epoch: int, mix: Optional[StepMix]) -> np.ndarray:
        """The sample indices this replica asks ``images`` for at a step: its own, then (mixing) its
        samples' partners."""
        own = self.sharding.replica_batch(epoch, step_in_epoch, self.coord.dp, self.mesh.dp)[0]
        return own if mix is None else np.concatenate([own, mix.partners(self.coord.dp)])

    def test_indices(self, split: str = "test") -> list[np.ndarray]:
        """Every replica's share of the held-out set (each sample once): the test split, or for
        ``split`` "val" the validation images of the train split (``Sharding.val_indices``)."""
        if split == "val":
            val = self.sharding.val_indices()
            return [replica_val_indices(val, self.mesh.dp, r) for r in range(self.mesh.dp)]
        return [replica_test_indices(self.source.test_size, self.mesh.dp, r) for r in range(self.mesh.dp)]

    def announce(self, split: str, epoch: int, batches: list[np.ndarray]) -> None:
        """Tell the source the index arrays ``images`` will be asked for next, in order (first stage only:
        the others read no images)."""
        if self.is_first:
            self.source.prefetch(split, epoch, batches)

    # ------------------------------------------------------------------ micro-batches
    def train(self, epoch: int, replica_idx: list[np.ndarray], n_mb: int, clock: StepClock,
              graph: Optional[StepGraph]) -> MicroBatches:
        """The step's ``n_mb`` micro-batches. The first stage reads the step's batch at once (the
        stall is timed by ``clock``) and slices it; with ``graph`` (a CUDA graph step) images and labels
        are copied into the graph's static buffers."""
        idx = replica_idx[self.coord.dp]
        slices = split_slices(len(idx), n_mb)
        inputs = lambda m: None  # noqa: E731
        mix = self.mix
        if self.is_first:
            clock.input_begin()  # (the wait for the batch not overlapped with compute: input stall)
            read = idx if mix is None else np.concatenate([idx, mix.partners(self.coord.dp)])
            x_all = self._images("train", read, epoch)  # (announced ahead to the loader)
            if mix is not None:
                x_all = mix_images(mix.draw, x_all[:len(idx)], x_all[len(idx):])
            clock.input_end()
            if graph is not None:
                x_all = graph.buffer("images", x_all)
            inputs = lambda m: x_all[slices[m]]  # noqa: E731
        labels, before_forward = self._labels("train", replica_idx, n_mb, graph, mix)
        return MicroBatches([s.stop - s.start for s in slices], inputs, labels, before_forward)

    def evaluate(self, replica_idx: list[np.ndarray], n_microbatches: int,
                 split: str = "test") -> MicroBatches:
        """This replica's share of the held-out ``split`` ("test", or "val") in ``n_microbatches``
        micro-batches, read one at a time (it can be far larger than a batch), announced first."""
        idx = replica_idx[self.coord.dp]
        slices = split_slices(len(idx), n_microbatches)
        self.announce(split, 0, [idx[sl] for sl in slices])
        inputs = lambda m: None  # noqa: E731
        if self.is_first:
            inputs = lambda m: self._images(split, idx[slices[m]], 0)  # noqa: E731
        labels, before_forward = self._labels(split, replica_idx, n_microbatches, None)
        return MicroBatches([s.stop - s.start for s in slices], inputs, labels, before_forward)

    def calibration(self, steps: range, n_mb: int) -> Iterator[tuple[int, MicroBatches]]:
        """The training batches of global steps ``steps`` as training reads them (augmented as in their
        epoch, without mixup or cutmix), each in ``n_mb`` micro-batches without labels, for precise BN
        (``actor/precise_bn.py``), as (step, micro-batches); a batch that leaves some replica no sample
        is skipped. Each epoch's batches are announced before they are read; once read, the training
        order is announced again from ``steps.start`` (the next step), as it was before."""
        spe = self.sharding.steps_per_epoch
        for epoch, group in itertools.groupby(steps, lambda s: s // spe):
            group = list(group)
            dp = self.mesh.dp
            batches = [[self.sharding.replica_batch(epoch, s % spe, r, dp)[0] for r in range(dp)]
                       for s in group]
            self.announce("train", epoch, [b[self.coord.dp] for b in batches])
            for step, replica_idx in zip(group, batches):
                if min(len(r) for r in replica_idx) == 0:
                    continue
                idx = replica_idx[self.coord.dp]
                slices = split_slices(len(idx), n_mb)
                inputs = lambda m: None  # noqa: E731
                if self.is_first:
                    x_all = self._images("train", idx, epoch)
                    inputs = lambda m, x=x_all, sl=slices: x[sl[m]]  # noqa: E731
                yield step, MicroBatches([s.stop - s.start for s in slices], inputs, lambda m: None,
                                         self._gather_sizes(replica_idx, n_mb))
        epoch, step_in_epoch = divmod(steps.start, spe)
        if self.epochs is None or epoch < self.epochs:
            self._announce_epoch(epoch, step_in_epoch)

    def _gather_sizes(self, replica_idx: list[np.ndarray], n_mb: int) -> Optional[Callable[[int], None]]:
        """Under the per-layer plan, what sets the batch gather to micro-batch m's sizes (one per
        replica) before its forward; None otherwise."""
        if self.batch_gather is None:
            return None
        per_replica = [split_slices(len(r), n_mb) for r in replica_idx]
        gather = self.batch_gather

        def set_sizes(m: int) -> None:
            gather.sizes = [sl[m].stop - sl[m].start for sl in per_replica]
        return set_sizes

    def _images(self, split: str, idx: np.ndarray, epoch: int) -> torch.Tensor:
        x = self.source.images(split, idx, self.device, epoch, dtype=self.input_dtype)
        return (
            x.contiguous(memory_format=torch.channels_last)
            if self.device.type == "cuda" and x.dim() == 4
            else x
        )

    def _targets(self, split: str, replica: int, idx: np.ndarray, mix: Optional[StepMix]) -> torch.Tensor:
        """Replica ``replica``'s labels of samples ``idx`` (N,), or mixed with its partners' as soft
        targets (N, K) of ``target_dtype``."""
        y = self.source.labels(split, idx)
        if mix is None:
            return y
        partner = self.source.labels(split, mix.partners(replica))
        return mix_targets(mix.draw, y, partner, self.source.num_classes, self.target_dtype)

    def _labels(self, split: str, replica_idx: list[np.ndarray], n_mb: int, graph: Optional[StepGraph],
                mix: Optional[StepMix] = None):
        """(labels(m) on the device, before_forward or None): this replica's micro-batch m on the last
        stage; under the per-layer plan micro-batch m of every replica, in replica order, and the batch
        gather's sizes set before each forward. With ``mix``, soft targets (``_targets``)."""
        labels: Callable[[int], Optional[torch.Tensor]] = lambda m: None  # noqa: E731
        before_forward = None
        if self.batch_gather is not None:
            per_replica = [split_slices(len(r), n_mb) for r in replica_idx]
            y = [self._targets(split, r, idx, mix) for r, idx in enumerate(replica_idx)]
            host = lambda m: torch.cat([yr[sl[m]] for yr, sl in zip(y, per_replica)])  # noqa: E731
            before_forward = self._gather_sizes(replica_idx, n_mb)
        elif self.is_last:
            idx = replica_idx[self.coord.dp]
            slices = split_slices(len(idx), n_mb)
            # (a stage that read the images may have its labels on the device already, copied with them)
            made = (
                self.source.device_labels(split, idx, self.device) if self.is_first and mix is None else None
            )
            y_all = made if made is not None else self._targets(split, self.coord.dp, idx, mix)
            host = lambda m: y_all[slices[m]]  # noqa: E731
        else:
            return labels, None
        if graph is None:
            return (lambda m: to_device(host(m), self.device)), before_forward
        parts = [host(m) for m in range(n_mb)]
        y_dev = graph.buffer("labels", to_device(parts[0] if n_mb == 1 else torch.cat(parts), self.device))
        views = torch.split(y_dev, [len(h) for h in parts])
        return (lambda m: views[m]), before_forward

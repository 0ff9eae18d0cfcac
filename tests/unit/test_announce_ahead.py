"""The next epoch's batches are announced to the source during the epoch's last step
(``Batches.announce_next``), so that a source reads them ahead across the epoch boundary; never past the run's
last epoch; a resumed actor announces the rest of its first epoch; every batch ``images`` is asked for was
announced, in order."""

from __future__ import annotations

import numpy as np
import torch

from rayconv.actor.batches import Batches
from rayconv.actor.steptime import StepClock
from rayconv.data.digits import load_digits
from rayconv.data.source import Sharding, TensorSource
from rayconv.mesh import Mesh


class Recording(TensorSource):
    """The digits, recording each announcement (split, epoch, batches) and each ``images`` call, against
    what was announced and not yet read."""

    def __init__(self):
        d = load_digits()
        super().__init__(d.sets["train"], d.sets["test"], d.num_classes)
        self.announced: list[tuple[str, int, list[np.ndarray]]] = []
        self.queue: list[np.ndarray] = []
        self.unannounced = 0

    def prefetch(self, split, epoch, batches):
        self.announced.append((split, epoch, [np.asarray(b).copy() for b in batches]))
        self.queue = list(self.announced[-1][2])

    def images(self, split, idx, device, epoch=0, dtype=None):
        if self.queue and np.array_equal(self.queue[0], idx):
            self.queue.pop(0)
        else:
            self.unannounced += 1
        return super().images(split, idx, device, epoch, dtype)


def _run(source: Recording, steps: range, epochs, dp: int = 1, mix=(0.0, 0.0)) -> list[tuple[int, int]]:
    """Steps as ``actor.step`` runs them (indices, the batch read, then ``announce_next``): (step, epoch
    announced) for each announcement made at that step."""
    cpu = torch.device("cpu")
    sharding = Sharding(source.train_size, 160, seed=3)
    batches = Batches(source, sharding, Mesh(dp=dp), Mesh(dp=dp).coord(0), cpu, torch.float32, None,
                      mix=mix, epochs=epochs)
    batches.first_step = steps.start
    made = []
    for step in steps:
        before = len(source.announced)
        epoch, replica_idx = batches.train_indices(step)
        batches.train(epoch, replica_idx, 1, StepClock(cpu), None)
        batches.announce_next(step)
        made += [(step, e) for _, e, _ in source.announced[before:]]
    return made


def test_the_next_epoch_is_announced_at_the_last_step_of_this_one():
    source = Recording()
    spe = Sharding(source.train_size, 160, seed=3).steps_per_epoch
    assert source.train_size % 160, "the digits' epoch should end in a partial batch"
    made = _run(source, range(0, 3 * spe), epochs=3)
    # epoch 0 at the run's first step; 1 and 2 at the last step of the epoch before; none past epoch 2
    assert made == [(0, 0), (spe - 1, 1), (2 * spe - 1, 2)]
    assert source.unannounced == 0
    for _, epoch, batches in source.announced:
        assert len(batches) == spe and sum(len(b) for b in batches) == source.train_size
        want = Sharding(source.train_size, 160, seed=3).epoch_permutation(epoch)
        assert np.array_equal(np.concatenate(batches), want)


def test_a_run_of_unknown_length_announces_every_next_epoch_and_a_resume_its_rest():
    source = Recording()
    spe = Sharding(source.train_size, 160, seed=3).steps_per_epoch
    made = _run(source, range(spe + 2, 3 * spe), epochs=None)
    assert made == [(spe + 2, 1), (2 * spe - 1, 2), (3 * spe - 1, 3)]
    assert len(source.announced[0][2]) == spe - 2   # the resumed epoch: from its third step on
    assert source.unannounced == 0


def test_under_mixing_and_data_parallel_the_announcements_name_what_is_read():
    """Replica 0 of 2 with cutmix: each announced batch is its samples then their partners'."""
    source = Recording()
    spe = Sharding(source.train_size, 160, seed=3).steps_per_epoch
    made = _run(source, range(0, 2 * spe), epochs=2, dp=2, mix=(0.0, 1.0))
    assert made == [(0, 0), (spe - 1, 1)]
    assert source.unannounced == 0


def test_precise_bn_batches_are_announced_and_the_training_order_announced_again():
    """``Batches.calibration`` (precise BN) between steps 3 and 4 reads steps 4 .. spe + 1 (across the
    epoch's end), each epoch's batches announced first, then announces the training order again from
    step 4: every later step reads an announced batch, the same images the calibration read."""
    source = Recording()
    cpu = torch.device("cpu")
    sharding = Sharding(source.train_size, 160, seed=3)
    spe = sharding.steps_per_epoch
    batches = Batches(source, sharding, Mesh(), Mesh().coord(0), cpu, torch.float32, None, epochs=2)
    read = {}

    def step(s):
        epoch, replica_idx = batches.train_indices(s)
        read[s] = batches.train(epoch, replica_idx, 1, StepClock(cpu), None).inputs(0)
        batches.announce_next(s)

    for s in range(4):
        step(s)
    calibration = {s: mb.inputs(0) for s, mb in batches.calibration(range(4, spe + 2), 1)}
    assert list(calibration) == list(range(4, spe + 2)) and source.unannounced == 0
    assert [(e, len(b)) for _, e, b in source.announced[-3:]] == [(0, spe - 4), (1, 2), (0, spe - 4)]
    for s in range(4, spe + 2):
        step(s)
    assert source.unannounced == 0
    for s, x in calibration.items():
        assert torch.equal(x, read[s])


class Foreseeing(Recording):
    """A source streamed from object storage (``stream`` set): also told the next epoch's batches."""

    stream = object()

    def __init__(self):
        super().__init__()
        self.foreseen: list[tuple[int, list[np.ndarray]]] = []

    def foresee(self, split, epoch, batches):
        assert split == "train"
        self.foreseen.append((epoch, [np.asarray(b).copy() for b in batches]))


def test_a_streamed_source_foresees_each_next_epoch_as_it_is_later_announced():
    source = Foreseeing()
    spe = Sharding(source.train_size, 160, seed=3).steps_per_epoch
    _run(source, range(0, 3 * spe), epochs=3, dp=2, mix=(0.0, 1.0))
    assert [e for e, _ in source.foreseen] == [1, 2]   # none past the run's last epoch
    for epoch, batches in source.foreseen:   # what was foreseen is what was announced for that epoch
        announced = next(b for _, e, b in source.announced if e == epoch)
        assert len(batches) == len(announced) and all(map(np.array_equal, batches, announced))
    assert source.unannounced == 0

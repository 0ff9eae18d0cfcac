"""The bench's warm-up length (``bench.measure.warmup_steps``): through the first epoch when it ends in a
partial batch, so that the partial batch's one-time set-up is not timed."""

from rayconv.bench.measure import WARMUP_EPOCH_MAX, warmup_steps
from rayconv.data.source import Sharding


def sharding(train_size: int, batch: int, val_split: float = 0.0) -> Sharding:
    return Sharding(train_size=train_size, global_batch_size=batch, seed=0, val_split=val_split)


def test_an_epoch_ending_in_a_partial_batch_is_warmed_up_whole():
    assert warmup_steps(20, sharding(70_000, 512)) == 137          # 136 full batches and one of 368


def test_whole_batches_keep_the_asked_warm_up():
    assert warmup_steps(20, sharding(71_680, 512)) == 20           # 140 full batches


def test_the_validation_split_counts_in_the_epoch():
    # 71,680 train images less 10% held out: 64,512 = 126 batches exactly
    assert warmup_steps(5, sharding(71_680, 512, val_split=0.1)) == 5
    assert warmup_steps(5, sharding(71_681, 512, val_split=0.1)) == 127


def test_a_long_epoch_or_a_longer_warm_up_is_left_as_asked():
    assert warmup_steps(20, sharding(512 * WARMUP_EPOCH_MAX + 1, 512)) == 20
    assert warmup_steps(200, sharding(70_000, 512)) == 200

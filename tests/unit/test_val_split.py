"""--val-split: the held-out train images (``Sharding.val_indices``) from the seed alone, never in a
training batch, the same for every dp and after a resume; the epoch shortened; the "val" split of the
sources read unaugmented; the evaluation's figures, the test split's schedule and the accuracy that
--target-accuracy and --keep-best read; the checks of the flags."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from rayconv.config import Config
from rayconv.data.on_device import OnDeviceSource
from rayconv.data.order import BlockOrder
from rayconv.data.source import Sharding, TensorSource, replica_val_indices
from rayconv.data.synthetic import SyntheticSource
from rayconv.driver.best import Best, load_best, write_best
from rayconv.driver.loop import eval_figures, evaluates_test, selection_metric
from rayconv.driver.progress import eval_line
from rayconv.driver.target import Target
from rayconv.errors import ConfigError
from rayconv.outputs.metrics import SCHEMA

N, BATCH = 1438, 102


def trained_indices(sh: Sharding, epoch: int, dp: int) -> np.ndarray:
    """Every replica's samples of every step of ``epoch``, in order."""
    return np.concatenate([sh.replica_batch(epoch, s, r, dp)[0] for s in range(sh.steps_per_epoch)
                           for r in range(dp)])


def test_held_out_images_come_from_the_seed_and_never_train():
    sh = Sharding(N, BATCH, seed=3, val_split=0.1)
    val = sh.val_indices()
    assert len(val) == 143 and np.array_equal(val, np.unique(val)) and val.dtype == np.int64
    # batch, dp: no matter
    assert np.array_equal(val, Sharding(N, 64, seed=3, val_split=0.1).val_indices())
    assert not np.array_equal(val, Sharding(N, BATCH, seed=4, val_split=0.1).val_indices())
    assert sh.train_samples == N - 143 and sh.steps_per_epoch == -(-(N - 143) // BATCH) == 13
    for epoch in range(2):
        seen = trained_indices(sh, epoch, 1)
        assert len(seen) == N - 143 and not np.isin(seen, val).any()
        assert np.array_equal(np.sort(np.concatenate([seen, val])), np.arange(N))
    assert len(Sharding(N, BATCH, seed=3).val_indices()) == 0   # default: none held out


def test_every_dp_and_a_resumed_run_see_the_same_batches():
    one = Sharding(N, BATCH, seed=7, val_split=0.25)
    for dp in (2, 4):
        other = Sharding(N, BATCH, seed=7, val_split=0.25)
        for epoch in range(2):
            assert np.array_equal(trained_indices(other, epoch, dp), trained_indices(one, epoch, 1))
        shares = [replica_val_indices(other.val_indices(), dp, r) for r in range(dp)]
        assert np.array_equal(np.concatenate(shares), one.val_indices())   # each validation image once
    later = Sharding(N, BATCH, seed=7, val_split=0.25)   # a resumed run: built afresh, mid-epoch 1
    assert np.array_equal(later.global_batch(1, 5), one.global_batch(1, 5))


def test_block_order_leaves_the_held_out_images_out_and_keeps_its_windows():
    rows = (7, 7, 7, 7, 7, 5, 7, 7, 7, 3)
    order = BlockOrder(rows, 3, seed=2)
    sh = Sharding(sum(rows), 12, seed=2, order=order, val_split=0.2)
    val, full = sh.val_indices(), order.epoch_order(1)
    got = sh.epoch_permutation(1)
    assert np.array_equal(got, full[~np.isin(full, val)])   # the block order's, less the held-out images
    assert sh.steps_per_epoch == -(-(64 - 12) // 12)


def test_a_split_that_holds_out_nothing_and_bad_flags_are_refused():
    with pytest.raises(ConfigError, match="--val-split 0.0001 holds out no image"):
        Sharding(100, 10, seed=0, val_split=1e-4).val_indices()
    for bad, match in [(dict(val_split=1.0), "--val-split must be a fraction in"),
                       (dict(val_split=-0.1), "--val-split must be a fraction in"),
                       (dict(eval_test=True), "--eval-test applies to a run with a validation split"),
                       (dict(keep_best=True), "--keep-best applies to a run with a validation split"),
                       (dict(tensorboard="yes"), "--tensorboard"), (dict(log_images=-1), "--log-images"),
                       (dict(log_images=4, tensorboard="off"), "--log-images puts its grid")]:
        with pytest.raises(ConfigError, match=match):
            Config(**bad).validate()
    Config(val_split=0.1, eval_test=True, keep_best=True).validate()


def test_the_sources_val_split_is_the_train_images_unaugmented():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (20, 1, 12, 12), dtype=np.uint8), rng.integers(0, 10, 20)
    # The test split holds the same images: its reading is the evaluation's, unaugmented.
    held = OnDeviceSource((x, y), (x, y), 10, seed=0, augment="pad-crop", random_erase=0.5)
    held.add_val_split()
    idx, cpu = np.array([3, 0, 17]), torch.device("cpu")
    assert torch.equal(held.images("val", idx, cpu, epoch=2), held.images("test", idx, cpu))
    assert not torch.equal(held.images("train", idx, cpu, epoch=2), held.images("test", idx, cpu))
    assert torch.equal(held.labels("val", idx), torch.as_tensor(y[idx]))
    assert held._on(cpu)["val"] is held._on(cpu)["train"]   # no second copy on the device
    tensors = TensorSource(*(torch.utils.data.TensorDataset(torch.randn(5, 1, 8, 8), torch.arange(5)),) * 2,
                           5)
    tensors.add_val_split()
    assert torch.equal(tensors.images("val", idx[:2], cpu), tensors.images("train", idx[:2], cpu))
    synth = SyntheticSource(8, 10, 64, seed=0)
    synth.add_val_split()
    assert torch.equal(synth.labels("val", idx), synth.labels("train", idx))


def test_imagefolder_val_split_reads_the_train_folder_as_the_test_split(tmp_path):
    from support.image_folder import write_folder
    from rayconv.data.imagefolder import ImageFolderSource

    root = write_folder(tmp_path / "f", train=3, val=1)
    shutil.rmtree(root / "val")
    shutil.copytree(root / "train", root / "val")   # val holds train's images: the same reading
    src = ImageFolderSource(str(root), 16, seed=0, workers=0, augment="resized-crop")
    src.add_val_split()
    idx, cpu = np.arange(src.train_size), torch.device("cpu")
    assert torch.equal(src.images("val", idx, cpu), src.images("test", idx, cpu))
    assert not torch.equal(src.images("train", idx, cpu), src.images("test", idx, cpu))
    assert torch.equal(src.labels("val", idx), src.labels("train", idx))


def test_eval_rows_name_the_split_and_the_target_reads_validation():
    res = [{"loss_sum": 3.0, "correct": 6, "correct5": 9, "samples": 10},
           {"loss_sum": 1.0, "correct": 2, "correct5": 3, "samples": 5}]
    val = eval_figures(res, "val")
    assert val == pytest.approx({"val_loss": 4 / 15, "val_accuracy": 8 / 15, "val_top5_accuracy": 12 / 15})
    assert set(eval_figures(res)) == {"test_loss", "test_accuracy", "test_top5_accuracy", "test_error"}
    assert set(val) <= set(SCHEMA.names)
    assert eval_line({**val, "test_accuracy": None}) == \
        f"val_loss {4 / 15:.4f} val_accuracy {8 / 15:.4f} val_top5_accuracy {12 / 15:.4f}"
    cfg = Config(val_split=0.1)
    assert selection_metric(cfg) == "val_accuracy" and selection_metric(Config()) == "test_accuracy"
    assert [evaluates_test(cfg, s, 30) for s in (9, 19, 29)] == [False, False, True]   # the test split once
    assert all(evaluates_test(dataclasses.replace(cfg, eval_test=True), s, 30) for s in (9, 29))
    assert all(evaluates_test(Config(), s, 30) for s in (9, 29))
    target = Target(0.5)
    ev = {**val, "test_accuracy": 0.9}
    # val 0.53 < 0.6: test's 0.9 ignored
    assert not Target(0.6).update(9, ev.get(selection_metric(cfg)), 1.0, 1.0)
    assert target.update(9, ev.get(selection_metric(cfg)), 1.0, 1.0) and target.step == 9


def test_best_folder_is_swapped_in_whole_and_read_back(tmp_path):
    assert load_best(tmp_path) == Best()
    assert Best().improves(0.1) and not Best(3, 0.5).improves(0.5) and Best(3, 0.5).improves(0.6)
    write_best(tmp_path, 4, 0.5, lambda p: p.write_bytes(b"step 4"))
    write_best(tmp_path, 9, 0.7, lambda p: p.write_bytes(b"step 9"))
    assert load_best(tmp_path) == Best(9, 0.7) and (tmp_path / "best" / "model.pt").read_bytes() == b"step 9"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    assert Best(9, 0.7).summary() == {"best_step": 9, "best_val_accuracy": 0.7}


def test_a_resume_with_another_split_is_refused(tmp_path):
    from rayconv.errors import CheckpointError
    from rayconv.outputs.checkpoint import Checkpoint, check_resumable

    manifest = {"model": "convnet", "num_classes": 10, "sample_shape": [1, 8, 8],
                "config": {"val_split": 0.1},
                "layout": {"dp": 1, "pp": 1, "fs": 1, "plan": "none", "stages": [["a"]]}}
    ckpt = Checkpoint(tmp_path / "checkpoints" / "step-4", manifest, {})
    mesh = type("M", (), {"dp": 1, "pp": 1, "fs": 1})()
    check_resumable(ckpt, Config(val_split=0.1), mesh, [["a"]], 10, (1, 8, 8))
    with pytest.raises(CheckpointError,
                       match="trained with --val-split 0.1, this run asks for --val-split 0: "
                             "resume with --val-split 0.1"):
        check_resumable(ckpt, Config(), mesh, [["a"]], 10, (1, 8, 8))

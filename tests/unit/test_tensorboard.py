"""rayconv.outputs.tensorboard: the metrics rows as TensorBoard scalars (read back with TensorBoard's
own EventAccumulator), each row once, a continued run's events purged from its first step, the image
grid; without the tensorboard package, one note and no files."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from rayconv.outputs.metrics import MetricsLog

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from rayconv.outputs.tensorboard import EventFiles  # noqa: E402


def rows(steps, scale=1.0):
    log = MetricsLog()
    for k in steps:
        log.add(kind="train", step=k, epoch=0, loss=scale / (k + 1), lr=0.1, images_per_s=100.0 + k,
                input_stall_ms=0.5, loss_scale=None)
    log.add(kind="eval", step=steps[-1], epoch=0, val_accuracy=0.4, val_loss=1.5, test_accuracy=0.5,
            test_loss=1.2, test_top5_accuracy=None)
    return log.rows


def read(out):
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_rows_become_scalars_once_and_a_resume_purges_from_its_step(tmp_path):
    events = EventFiles(tmp_path)
    events.add_rows(rows([0, 1, 2]))
    events.add_rows(rows([0, 1, 2, 3]))   # metrics.parquet rewritten with one more row: only it is added
    events.close()
    acc = read(tmp_path)
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/images_per_s", "train/input_stall_ms", "val/accuracy",
            "val/loss", "test/accuracy", "test/loss"} <= set(tags)
    assert "train/loss_scale" not in tags and "test/top5_accuracy" not in tags   # (null in every row)
    assert scalars(acc, "train/loss") == [(0, 1.0), (1, 0.5), (2, round(1 / 3, 6)), (3, 0.25)]
    assert scalars(acc, "val/accuracy") == [(2, 0.4), (3, 0.4)]
    # A run continued from step 2 in the same folder: what the first wrote from step 2 on is hidden.
    # (A resumed run writes its file seconds later, from another process; TensorBoard reads a folder's
    # files in name order, and two writers of one process within a second are told apart by a counter
    # whose digits sort as text: 10 before 9. The second writer here starts in the next second.)
    time.sleep(1.0 - time.time() % 1.0 + 0.05)
    again = EventFiles(tmp_path, start=2)
    again.add_rows(rows([0, 1, 2, 3, 4], scale=2.0))
    again.close()
    assert scalars(read(tmp_path), "train/loss") == [(0, 1.0), (1, 0.5), (2, round(2 / 3, 6)), (3, 0.5),
                                                     (4, 0.4)]


def test_metrics_write_adds_the_rows_and_the_image_grid(tmp_path):
    events = EventFiles(tmp_path)
    log = MetricsLog()
    log.rows = rows([0])
    log.on_write = events.add_rows
    log.write(tmp_path / "metrics.parquet")
    events.add_image_grid(torch.randn(6, 1, 8, 8))
    events.close()
    acc = read(tmp_path)
    assert scalars(acc, "train/lr") == [(0, 0.1)]
    [image] = acc.Images("train/images")
    assert image.step == 0 and image.width > 8 and image.height > 8   # 6 images in one grid


def test_without_the_package_the_run_goes_on_after_one_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)   # (an import of it fails)
    notes = []
    events = EventFiles(tmp_path, log=notes.append)
    events.add_rows(rows([0]))
    events.add_rows(rows([0, 1]))
    assert len(notes) == 1 and "pip install tensorboard" in notes[0] and not (
        tmp_path / "tensorboard").exists()
    off = EventFiles(tmp_path / "off", enabled=False, log=notes.append)
    off.add_rows(rows([0]))
    assert len(notes) == 1 and not (tmp_path / "off").exists()


def test_the_image_grid_is_of_augmented_training_images_and_skips_data_held_on_the_device(tmp_path):
    import numpy as np

    from rayconv.data.on_device import OnDeviceSource
    from rayconv.data.small import HeldSource
    from rayconv.outputs.tensorboard import first_images

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (12, 1, 10, 10), dtype=np.uint8), rng.integers(0, 10, 12)
    src = OnDeviceSource((x, y), (x, y), 10, seed=0, augment="pad-crop")
    batch = np.array([5, 1, 8, 0])
    got = first_images(src, batch, 3)
    assert torch.equal(got, src.images("train", batch[:3], torch.device("cpu"), 0))   # as the step sees them
    assert not torch.equal(got, src.images("test", batch[:3], torch.device("cpu")))
    held = HeldSource.__new__(HeldSource)   # (its first read would decode the whole data set here)
    assert first_images(held, batch, 3) is None

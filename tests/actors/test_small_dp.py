"""--data-on-device on a real local Ray cluster: a tiny image folder and a tiny shard folder held on the
device (auto: 32-pixel pad-crop, far below the size limit), and a raw-pixel shard folder streamed
(--data-on-device off), dp=2 equals single-device SGD on the same augmented batches, parameter for
parameter (the reference builds its source with make_source too, so it holds the same decoded images)."""

from __future__ import annotations

import json

import pytest
import torch

from support.helpers import assert_same_state, reference_sgd
from support.image_folder import write_folder
from rayconv.config import Config
from rayconv.data.raw_shards import RawShardSource
from rayconv.data.registry import make_source
from rayconv.data.shard_writer import prepare
from rayconv.data.small import HeldSource
from rayconv.driver.job import train_run
from rayconv.models import build_model

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 2


@pytest.mark.parametrize("data,augmentation", [pytest.param("imagefolder", {}, marks=pytest.mark.slow),
                                               ("shards", dict(auto_augment="ta_wide", random_erase=0.5)),
                                               ("raw", dict(random_erase=0.5, data_on_device="off"))])
def test_dp2_on_held_data_matches_single_device_sgd(ray_cluster, tmp_path, data, augmentation):
    root = write_folder(tmp_path / "src", ".jpg" if data == "shards" else ".png", train=8, val=2)
    if data in ("shards", "raw"):   # raw: raw-pixel shards, streamed
        prepare(str(root), str(tmp_path / "shards"), size=40, shard_size=4, log=lambda *_: None, processes=1,
                encoding="raw" if data == "raw" else "jpeg")
        root, data = tmp_path / "shards", "shards"
    cfg = Config(model="convnet", data=data, data_dir=str(root), image_size=32, dp=2, global_batch_size=8,
                 **augmentation, steps=STEPS, lr=0.05, momentum=0.9, weight_decay=5e-4, precision="fp64",
                 device="cpu", loader_workers=0, progress=False, out=str(tmp_path / "run")).validate()
    assert isinstance(make_source(cfg), RawShardSource if cfg.data_on_device == "off" else HeldSource)
    lines: list[str] = []
    train_run(cfg, log=lines.append)
    held = cfg.data_on_device != "off"
    # --data-on-device auto, resolved against the cluster: two CPU actors on one node share its memory.
    assert (
        any(
            x.startswith("rayconv: --data-on-device auto: both splits held on the device (")
            and "of the node's memory" in x
            and "/ 2 actors holding a copy)" in x
            for x in lines
        )
        == held
    ), lines[:6]
    # --data-on-device off (raw shards): the console says how the batches come, as given.
    assert (
        "rayconv: --data-on-device off: each batch read from the raw shards, no decode (as given)" in lines
    ) == (not held), lines[:6]
    # Held data is decoded in the actors' build, before the first step, and reported apart.
    startup = json.loads((tmp_path / "run" / "summary.json").read_text())["startup"]
    assert (startup.get("decoded_images") == 20 and startup.get("decode_s", 0) > 0) == held
    assert any(line.startswith("rayconv: decoded 20 images in ") for line in lines) == held
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert_same_state(got, reference_sgd(cfg, STEPS), atol=1e-10)
    torch.manual_seed(cfg.seed)
    init = build_model("convnet", 2, 3, 32).double().state_dict()
    assert max((got[k].double() - init[k]).abs().max().item() for k in init) > 1e-4

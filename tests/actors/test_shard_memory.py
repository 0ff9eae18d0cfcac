"""Memory-mapped shards keep each process's private memory flat with the data's size: two prepared
folders of the same image size, N and 10N images, trained a few steps with ``--dp 2`` through the real
loader (one worker process each); the peak RssAnon of every actor and of its loader process, as the
actors sample it (``rayconv/actor/rss.py``, reported in summary.json), grows by less than 10% from N
to 10N. (Loading the shards' JPEG bytes into each process instead grows both by the folder's growth.)"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rayconv.config import Config
from rayconv.data.shard_writer import prepare
from rayconv.driver.job import train_run

N, CLASSES, SIDE = 300, 10, 192   # noise JPEGs of 192 x 192: about 33 KB each prepared, 10N about 95 MB


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[int, Path]:
    """Prepared folders of N and 10N train images (the small one a subset of the large), 2 val per class.
    The N train images are generated; the large folder holds each of them 10 times under other names
    (hard links: prepare reads and encodes every file, and the shards hold every copy's bytes)."""
    src = {n: tmp_path_factory.mktemp(f"src{n}") for n in (N, 10 * N)}
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 10 * N // CLASSES), ("val", 2)):
        for c in range(CLASSES):
            for d in src.values():
                (d / split / f"c{c}").mkdir(parents=True)
            for i in range(per_class):
                big = src[10 * N] / split / f"c{c}" / f"{i}.JPEG"
                if split == "val" or i < N // CLASSES:
                    noise = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
                    Image.fromarray(noise).save(big, quality=90)
                    os.link(big, src[N] / split / f"c{c}" / f"{i}.JPEG")
                else:
                    os.link(src[N] / split / f"c{c}" / f"{i % (N // CLASSES)}.JPEG", big)
    out = {}
    for n, d in src.items():
        out[n] = tmp_path_factory.mktemp(f"shards{n}") / "s"
        prepare(str(d), str(out[n]), size=SIDE, shard_size=250, processes=1, log=lambda *_: None)
    return out


def _peaks(data: Path, out: Path) -> list[dict]:
    cfg = Config(model="convnet", data="shards", data_dir=str(data), image_size=32, dp=2,
                 global_batch_size=32, steps=6, eval_every=6, precision="fp32", device="cpu", progress=False,
                 loader_workers=1, decode="cpu", data_on_device="off", out=str(out)).validate()
    return train_run(cfg, log=lambda *_: None)["actors"]


@pytest.mark.slow
def test_private_memory_stays_flat_when_the_data_grows_tenfold(ray_cluster, folders, tmp_path):
    sizes = {n: sum(p.stat().st_size for p in d.iterdir()) for n, d in folders.items()}
    assert sizes[10 * N] > 8 * sizes[N] and sizes[10 * N] > 80e6
    small, big = _peaks(folders[N], tmp_path / "small"), _peaks(folders[10 * N], tmp_path / "big")
    print("peak RssAnon MiB (actor, loader) per rank: N",
          [(a["peak_rss_anon_mib"], a["loader_peak_rss_anon_mib"]) for a in small], "10N",
          [(a["peak_rss_anon_mib"], a["loader_peak_rss_anon_mib"]) for a in big],
          f"folders {sizes[N] / 2**20:.1f} and {sizes[10 * N] / 2**20:.1f} MiB")
    for s, b in zip(small, big):
        for key in ("peak_rss_anon_mib", "loader_peak_rss_anon_mib"):
            assert s[key] is not None and b[key] is not None, key
            assert b[key] < 1.10 * s[key], (key, s[key], b[key])

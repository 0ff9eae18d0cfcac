"""Shard format 2 under failure: a full disk while preparing (a real EFBIG, RLIMIT_FSIZE in a subprocess),
a folder of the older Parquet format refused and converted, and a shard that disappears during a run
(the run stops naming the file and the step; --resume continues once it is back). Small generated
images (benchmarks/make_images.py), CPU actors on the real local Ray cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from support.helpers import assert_same_state, reference_sgd
from rayconv import prepare as prep
from rayconv.config import Config
from rayconv.data.shard_writer import prepare
from rayconv.data.shards import ShardSource
from rayconv.driver.job import train_run
from rayconv.errors import DataError
from rayconv.files import sha256_file
from rayconv.run import main

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from make_images import _write_class  # noqa: E402


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """2 classes: 8 train and 3 val JPEGs each, 48 x 40."""
    root = tmp_path_factory.mktemp("img")
    for split, n in (("train", 8), ("val", 3)):
        for c in range(2):
            _write_class((str(root), split, c, n, 0, 48, 40, 90))
    return root


@pytest.fixture(scope="module")
def straight(images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "s"
    prepare(str(images), str(out), size=40, shard_size=4, processes=1, log=lambda *_: None)
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_a_full_disk_leaves_no_half_shard_and_a_rerun_completes(images, straight, tmp_path):
    sizes = sorted(p.stat().st_size for p in straight.glob("*.arrow"))
    limit = (sizes[0] + sizes[-1]) // 2   # the 2-image shards fit, the 4-image ones do not
    assert sizes[0] < limit < sizes[-1]
    out = tmp_path / "s"
    script = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # write() then fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        from rayconv.data.shard_writer import prepare, write_shard
        serial = lambda args: ((n, write_shard(*a)) for n, a in reversed(list(args.items())))
        prepare({str(images)!r}, {str(out)!r}, size=40, shard_size=4, fan_out=serial)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr[-2000:]
    left = sorted(p.name for p in out.iterdir())
    assert left and not [n for n in left if n.endswith(".tmp") or n == "manifest.json"], left
    for name in left:   # what is there is complete
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name
    prepare(str(images), str(out), size=40, shard_size=4, processes=1, log=lambda *_: None)
    assert _files(out) == _files(straight)


def _as_format_1(src: Path, dest: Path) -> None:
    """Write ``src`` (format 2) as the older format: Parquet shards, manifest "rayconv-shards/1"."""
    dest.mkdir()
    manifest = json.loads((src / "manifest.json").read_text())
    for split in manifest["splits"].values():
        entries = []
        for e in split["shards"]:
            p = dest / (Path(e["file"]).stem + ".parquet")
            pq.write_table(pa.ipc.open_file(src / e["file"]).read_all(), p, compression="none",
                           row_group_size=1024)
            entries.append({"file": p.name, "rows": e["rows"], "bytes": p.stat().st_size,
                            "sha256": sha256_file(p)})
        split["shards"] = entries
    manifest["format"] = "rayconv-shards/1"
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def config(data_dir: Path, out: Path, **kw) -> Config:
    # 16 train images, global batch 6: steps of 6, 6 and 4 per epoch.
    base = dict(model="convnet", data="shards", data_dir=str(data_dir), image_size=32, dp=2,
                global_batch_size=6, steps=5, lr=0.05, momentum=0.9, precision="fp64", device="cpu",
                progress=False, eval_every=5, loader_workers=1, decode="cpu", data_on_device="off",
                out=str(out))
    return Config(**{**base, **kw}).validate()


def test_format_1_is_refused_with_the_command_and_converted(ray_cluster, straight, tmp_path, capsys):
    old = tmp_path / "old"
    _as_format_1(straight, old)
    with pytest.raises(DataError, match=f"python -m rayconv.prepare --convert {old}"):
        ShardSource(str(old), 32, seed=0, workers=0)
    capsys.readouterr()
    assert main(["--data", "shards", "--data-dir", str(old), "--device", "cpu", "--steps", "1",
                 "--no-progress", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--convert {old}" in err[0], err
    assert prep.main(["--convert", str(old)]) == 0
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in straight.iterdir())
    assert json.loads((old / "manifest.json").read_text()) == json.loads(
        (straight / "manifest.json").read_text())
    cpu = torch.device("cpu")
    torch.testing.assert_close(
        ShardSource(str(old), 32, seed=0, workers=0).images("train", np.arange(16), cpu, 1),
        ShardSource(str(straight), 32, seed=0, workers=0).images("train", np.arange(16), cpu, 1))
    cfg = config(old, tmp_path / "run", steps=2, eval_every=2)
    assert train_run(cfg, log=lambda *_: None)["steps"] == 2


@pytest.mark.slow
def test_a_shard_removed_mid_run_stops_it_and_resume_continues(ray_cluster, straight, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for p in straight.iterdir():
        (data / p.name).write_bytes(p.read_bytes())
    shard, away = data / "train-00001.arrow", tmp_path / "away.arrow"

    def remove_after_checkpoint(actor_group, step):
        if step == 1:   # step-2 checkpointed: the shard goes
            shard.rename(away)

    cfg = config(data, tmp_path / "a", checkpoint_every=2, keep_checkpoints=0)
    with pytest.raises(DataError, match=rf"step [234]: {shard} disappeared during the run") as e:
        train_run(cfg, log=lambda *_: None, on_step=remove_after_checkpoint)
    assert "\n" not in str(e.value)
    assert (tmp_path / "a" / "checkpoints" / "step-2").is_dir()
    away.rename(shard)
    assert main(["--resume", str(tmp_path / "a"), "--no-progress"]) == 0
    assert_same_state(torch.load(tmp_path / "a" / "model.pt", weights_only=True), reference_sgd(cfg, 5),
                      atol=1e-10)

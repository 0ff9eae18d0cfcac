"""float16 with dynamic loss scaling on 2 replicas of a 2-stage pipeline (CPU autocast): an overflow
in one actor (replica 0's stage 1, after the gradient all-reduce, so no other actor sees an inf of its
own) skips the step on every actor of the mesh and halves the scale on every actor, and the run goes
on; the scale
and the moving average travel in the rank files, so a resumed run equals the straight one.

The overflow is forced: ``Actor.inject_overflow(step)`` makes stage 1's first gradient inf at
``INJECT`` (the other actors' gradients stay finite: only the mesh-wide MAX of the flag can make them
skip).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from rayconv.actor.actor import Actor
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import load_checkpoint
from rayconv.run import main

pytestmark = pytest.mark.takes_kept_actors   # (conftest: the previous module's kept actors stay for its runs)

STEPS = 6
INJECT = 2      # the step whose update stage 1's overflow skips
STOP_AFTER = 2  # the resume starts after step 2 (3 steps done; its checkpoint is step-3)
MESH = Mesh(dp=2, pp=2, fs=1)
STAGE1 = MESH.rank((0, 1, 0))  # replica 0's second stage


def fp16_config(out: Path) -> Config:
    # Global batch 16 (micro-batches of 4): float16 convolutions on CPU run on slow fallback kernels (about
    # 50 ms a sample forward and backward), and what is checked does not depend on the batch's size.
    return Config(model="convnet", data="digits", dp=2, pp=2, num_microbatches=2, global_batch_size=16,
                  steps=STEPS, lr=0.05, precision="fp16", device="cpu", progress=False, eval_every=STEPS,
                  checkpoint_every=3, model_ema=True, model_ema_steps=1, model_ema_decay=0.99,
                  loader_workers=0, out=str(out)).validate()


class Recorder:
    """on_step: asks stage 1 to overflow at INJECT (before that step is launched), then records every
    actor's state and loss scale after each step."""

    def __init__(self):
        self.states: dict[int, list[dict[str, torch.Tensor]]] = {}
        self.scales: dict[int, list[dict]] = {}

    def __call__(self, actor_group, step: int) -> None:
        if step == 0:
            actor_group.call(Actor.inject_overflow, INJECT, ranks=[STAGE1])
        self.states[step] = actor_group.call(Actor.model_state)
        self.scales[step] = actor_group.call(Actor.loss_scale_state)


@pytest.fixture(scope="module")
def straight(ray_cluster, tmp_path_factory) -> tuple[Path, Recorder]:
    out = tmp_path_factory.mktemp("fp16") / "straight"
    rec = Recorder()
    train_run(fp16_config(out), log=lambda *_: None, on_step=rec)
    return out, rec


def rank_state(ckpt: Path, rank: int) -> dict:
    """Rank ``rank``'s whole state, rebuilt from the parts the actors wrote (each tensor once)."""
    return load_checkpoint(ckpt).payloads()[rank]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_overflow_in_one_stage_skips_the_step_everywhere(straight):
    out, rec = straight
    assert sorted(rec.states) == list(range(STEPS))
    for step in range(STEPS):
        skipped = [s["skipped"] for s in rec.scales[step]]
        assert skipped == [step == INJECT] * MESH.world_size, f"step {step}: {skipped}"  # the same everywhere
        assert len({s["scale"] for s in rec.scales[step]}) == 1  # one scale over the mesh
        if step > 0:
            moved = [not _same(a, b) for a, b in zip(rec.states[step], rec.states[step - 1])]
            assert moved == [step != INJECT] * MESH.world_size, f"step {step}: parameters moved {moved}"
    before, after = rec.scales[INJECT - 1], rec.scales[INJECT]
    assert all(a["scale"] == b["scale"] / 2 for a, b in zip(after, before))
    assert before[0]["scale"] == 2.0 ** 16
    # The metrics row of each step carries the scale its loss was multiplied by.
    rows = [r for r in pq.read_table(out / "metrics.parquet").to_pylist() if r["kind"] == "train"]
    assert [r["loss_scale"] for r in rows] == [2.0 ** 16] * (INJECT + 1) + [2.0 ** 15] * (STEPS - INJECT - 1)
    assert all(torch.isfinite(v).all() for v in torch.load(out / "model.pt", weights_only=True).values())


@pytest.mark.slow
def test_resume_keeps_the_scale_and_the_average(straight, tmp_path_factory):
    """Resumed from the checkpoint after the skipped step (step-3): model, moving average and
    loss-scale state equal the straight run's exactly. The run folder resumed is the straight run's,
    cut back to what a run stopped after step 2 leaves (its checkpoint at step 3 is written before
    the step-6 one exists, so it is the same file): no step-6 checkpoint, no final files, the metrics
    of the checkpoint."""
    out, _ = straight
    branch = tmp_path_factory.mktemp("fp16") / "branch"
    shutil.copytree(out, branch)
    shutil.rmtree(branch / "checkpoints" / f"step-{STEPS}")
    for name in ("model.pt", "model_ema.pt", "summary.json"):
        (branch / name).unlink()
    shutil.copy(branch / "checkpoints" / f"step-{STOP_AFTER + 1}" / "metrics.parquet",
                branch / "metrics.parquet")
    assert sorted(p.name for p in (branch / "checkpoints").iterdir()) == [f"step-{STOP_AFTER + 1}"]
    assert rank_state(branch / "checkpoints" / "step-3", 0)["loss_scale"]["scale"] == 2.0 ** 15
    assert main(["--resume", str(branch)]) == 0
    for name in ("model.pt", "model_ema.pt"):
        assert _same(torch.load(branch / name, weights_only=True),
                     torch.load(out / name, weights_only=True)), name
    for r in range(MESH.world_size):
        got = rank_state(branch / "checkpoints" / f"step-{STEPS}", r)
        want = rank_state(out / "checkpoints" / f"step-{STEPS}", r)
        assert got["loss_scale"] == want["loss_scale"]
        assert got["ema"]["n_averaged"] == want["ema"]["n_averaged"]
        assert _same(got["ema"]["tensors"], want["ema"]["tensors"])


@pytest.mark.slow
def test_resume_under_another_layout_keeps_the_scale_and_the_average(straight, tmp_path):
    """The step-3 checkpoint (after the skipped step) continued on one actor: the rank files joined, and the
    loss scale's state (scale, growth tracker) and the average's count arrive as the straight run holds them
    at its end; the parameters agree to float16 rounding (float16 sums of another batch split round apart, so
    not bit for bit)."""
    out, _ = straight
    resumed = tmp_path / "dp1"
    assert main(["--resume", str(out / "checkpoints" / f"step-{STOP_AFTER + 1}"), "--dp", "1", "--pp", "1",
                 "--out", str(resumed)]) == 0
    got = rank_state(resumed / "checkpoints" / f"step-{STEPS}", 0)
    want = rank_state(out / "checkpoints" / f"step-{STEPS}", 0)
    assert got["loss_scale"] == want["loss_scale"] and got["loss_scale"]["scale"] == 2.0 ** 15
    assert got["ema"]["n_averaged"] == want["ema"]["n_averaged"]
    for name in ("model.pt", "model_ema.pt"):
        a, b = (torch.load(d / name, weights_only=True) for d in (resumed, out))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)

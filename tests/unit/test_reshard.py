"""Checkpoint re-cutting (rayconv.outputs.reshard), without Ray: a model's parts as the actors of one layout
hold them (``routing.build_part``, the function that cuts an actor's part at setup), joined into the
whole state and cut for another layout, equal the parts that layout cuts directly, parameter for
parameter; each parameter's momentum and moving average follow it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

from rayconv.actor.recipe_step import build_optimizer
from rayconv.config import Config
from rayconv.errors import CheckpointError
from rayconv.mesh import Mesh
from rayconv.models import build_model, to_layers
from rayconv.outputs.checkpoint import Checkpoint, rank_file_for
from rayconv.outputs.rank_files import deal, entries_of, rank_file_of, rank_payloads, split_payload
from rayconv.outputs.reshard import cut_part, join, optimizer_param_names, split_position, whole_blob
from rayconv.parallel.routing import build_part, make_routing
from rayconv.recipe.ema import PartEMA
from rayconv.recipe.loss_scale import DynamicLossScale

LAYOUTS = {  # name -> (dp, pp, fs, Config extras)
    "dp2xpp2": (2, 2, 1, {"num_microbatches": 2}),
    "pp2xfs2": (1, 2, 2, {"num_microbatches": 2}),
    "fs2": (1, 1, 2, {}),
    "fs3": (1, 1, 3, {}),  # uneven slices (32 and 64 filters over 3)
    "dp1": (1, 1, 1, {}),
    "pp2_interleaved": (1, 2, 1, {"virtual_stages": 2, "num_microbatches": 2}),
    "krizhevsky2014": (2, 1, 1, {"plan": "krizhevsky2014"}),
}


def momentum_of(p: torch.Tensor) -> torch.Tensor:
    """A momentum buffer that is a function of its parameter's values, so a misplaced one shows."""
    return 2 * p.detach() + 1


def model_layers() -> list:
    torch.manual_seed(0)
    model = build_model("convnet_bn", 10, 1, 8)
    for k, t in model.state_dict().items():  # batch-norm statistics too, so that each slice differs
        t.copy_(torch.full_like(t, 7) if k.endswith("num_batches_tracked") else torch.randn_like(t))
    return model, to_layers(model)


def parts(name: str, model, layers, **recipe):
    """Each rank's (coord, config, sliced part, module, optimizer) under layout ``name``, with the
    Config's ``recipe`` settings (the optimizer and its groups)."""
    dp, pp, fs, extra = LAYOUTS[name]
    cfg = Config(model="convnet_bn", data="digits", dp=dp, pp=pp, fs=fs, global_batch_size=8,
                 **extra, **recipe).validate()
    mesh = Mesh(dp, pp, fs)
    plan = make_routing(cfg, mesh, model, (1, 8, 8))
    out = []
    for r in range(mesh.world_size):
        c = mesh.coord(r)
        sliced, _ = build_part(plan, layers, c.pp, c.fs, None, c.dp, None)
        part = nn.Sequential(*sliced.modules)
        out.append((c, cfg, plan, sliced, part, build_optimizer(cfg, part)))
    return out


def named(sliced, part) -> dict[str, torch.Tensor]:
    return {(f"{n}.{k}" if n else k): v.detach().clone() for n, sub in zip(sliced.names, part)
            if n is not None for k, v in sub.state_dict().items()}


def optimizer_state_of(p: torch.Tensor, opt: str) -> dict[str, torch.Tensor]:
    """Each state tensor a function of its parameter's values (torch SGD's, LARS's included, or AdamW's)."""
    if opt == "adamw":
        return {"step": torch.tensor(5.0), "exp_avg": momentum_of(p), "exp_avg_sq": p.detach() ** 2 + 3}
    return {"momentum_buffer": momentum_of(p)}


def scaler_state() -> dict:
    """A ``DynamicLossScale``'s state after 3 steps, an overflow and 2 more: scale 2**15, 2 steps grown."""
    scaler = DynamicLossScale()
    for found in (False, False, False, True, False, False):
        scaler.update(found)
    return scaler.state_dict()


def saved(name: str, model, layers, **recipe) -> tuple[list[dict], dict]:
    """The rank-file payloads (as ``actor.state.rank_file`` writes them) and manifest layout: each
    parameter's optimizer state and moving average functions of its values, the groups' learning
    rate the step's (0.37), the average's count 5, the loss scale's state ``scaler_state``."""
    payloads = []
    for c, cfg, plan, sliced, part, opt in parts(name, model, layers, **recipe):
        for p in part.parameters():
            opt.state[p] = optimizer_state_of(p, cfg.opt)
        for g in opt.param_groups:
            g["lr"] = 0.37
        ema = PartEMA(part, 0.9)
        for v in ema.tensors.values():
            v.mul_(3)
        ema.n_averaged = 5
        payloads.append({"coord": list(c), "model": named(sliced, part),
                         "split_dims": dict(sliced.split_dims), "optimizer": opt.state_dict(),
                         "part_names": list(sliced.names),
                         "optimizer_names": optimizer_param_names(sliced.names, part, opt),
                         "ema": ema.state_dict(), "loss_scale": scaler_state(), "rng": {}})
    dp, pp, fs, _ = LAYOUTS[name]
    layout = {"dp": dp, "pp": pp, "fs": fs, "plan": cfg.plan, "world_size": dp * pp * fs,
              "stages": [list(s) for s in plan.stages]}
    return [torch.load(io.BytesIO(_bytes(p)), weights_only=True) for p in payloads], layout


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("source, target", [
    ("dp2xpp2", "fs2"), ("dp2xpp2", "dp1"), ("dp2xpp2", "pp2_interleaved"), ("dp2xpp2", "krizhevsky2014"),
    ("pp2xfs2", "fs3"), ("krizhevsky2014", "pp2xfs2"), ("fs3", "dp2xpp2"),
])
def test_recut_equals_direct_cut(source, target):
    model, layers = model_layers()
    payloads, layout = saved(source, model, layers)
    whole = join(payloads, layout)
    torch.testing.assert_close(whole["model"], model.state_dict(), rtol=0, atol=0)
    assert whole["loss_scale"] == scaler_state()
    for c, cfg, plan, sliced, part, opt in parts(target, model, layers):
        index, n = split_position(c, plan.mesh.dp, plan.mesh.fs, plan.per_layer_plan)
        got = cut_part(whole, sliced.names, part, opt, dict(sliced.split_dims), index, n)
        want = named(sliced, part)
        torch.testing.assert_close(got["model"], want, rtol=0, atol=0)
        opt.load_state_dict(got["optimizer"])  # fits this part's optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        assert len(opt.state) == len(params) > 0 or not params
        for p in params:
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], momentum_of(p), rtol=0, atol=0)
        ema = PartEMA(part, 0.9)
        ema.load_state_dict(got["ema"])
        for k, v in part.state_dict().items():
            torch.testing.assert_close(ema.tensors[k], 3 * v, rtol=0, atol=0)


RECIPES = {  # the optimizers and groups of the recipe, each with its own state and group settings
    # momentum SGD, the adapted group's decay as lars_weight_decay
    "lars": dict(opt="lars", weight_decay=1e-4),
    "nesterov-norm-bias": dict(opt="sgd_nesterov", norm_weight_decay=0.0, bias_weight_decay=0.0),
    "adamw": dict(opt="adamw"),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("source, target",
                         [("dp2xpp2", "fs3"), ("krizhevsky2014", "pp2xfs2"), ("pp2xfs2", "dp1")])
def test_recipe_state_follows_each_parameter(source, target, recipe):
    """Under the recipe's optimizers every state tensor follows its parameter, every group keeps its saved
    settings (learning rate, decay, LARS's own decay) under this part's grouping, and the moving
    average's count and the loss scale's state (scale, growth tracker) arrive as saved."""
    model, layers = model_layers()
    payloads, layout = saved(source, model, layers, **RECIPES[recipe])
    whole = join(payloads, layout)
    for c, cfg, plan, sliced, part, opt in parts(target, model, layers, **RECIPES[recipe]):
        want_groups = {g["name"]: {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups}
        index, n = split_position(c, plan.mesh.dp, plan.mesh.fs, plan.per_layer_plan)
        got = cut_part(whole, sliced.names, part, opt, dict(sliced.split_dims), index, n)
        opt.load_state_dict(got["optimizer"])
        for g in opt.param_groups:
            assert {k: v for k, v in g.items() if k != "params"} == {**want_groups[g["name"]], "lr": 0.37}
            for p in g["params"]:
                want = optimizer_state_of(p, cfg.opt)
                assert opt.state[p].keys() == want.keys()
                for k in want:
                    torch.testing.assert_close(opt.state[p][k], want[k], rtol=0, atol=0)
        ema = PartEMA(part, 0.5)
        ema.load_state_dict(got["ema"])
        assert (ema.decay, ema.n_averaged) == (0.9, 5)
        scaler = DynamicLossScale()
        scaler.load_state_dict(got["loss_scale"])
        assert (scaler.scale, scaler.growth_tracker) == (2.0 ** 15, 2)


def test_slices_that_do_not_cover_the_split_are_refused():
    model, layers = model_layers()
    payloads, layout = saved("fs2", model, layers)
    del payloads[1]["model"]["conv1.weight"]
    with pytest.raises(CheckpointError, match="conv1.weight cover split indices \\[0\\] only"):
        join(payloads, layout)


def test_rank_files_without_names_are_one_line_naming_their_layout():
    model, layers = model_layers()
    payloads, layout = saved("dp2xpp2", model, layers)
    unnamed = [{k: v for k, v in p.items() if k != "optimizer_names"} for p in payloads]
    with pytest.raises(CheckpointError, match="resume with --dp 2 --pp 2 --fs 1 --plan none"):
        whole_blob(unnamed, layout)


def test_rank_file_for_sends_the_whole_state_under_another_layout():
    model, layers = model_layers()
    payloads, layout = saved("dp2xpp2", model, layers)
    files = {f"rank-{r}.pt": _bytes(p) for r, p in enumerate(payloads)}
    ckpt = Checkpoint(path=Path("/nonexistent/step-2"), manifest={"layout": layout}, files=files)
    assert rank_file_for(ckpt, Mesh(2, 2, 1), 3) == files["rank-3.pt"]
    whole = torch.load(io.BytesIO(rank_file_for(ckpt, Mesh(1, 1, 2), 1)), weights_only=True)
    assert whole["whole"] and set(whole["model"]) == set(model.state_dict())


@pytest.mark.parametrize("name", ["dp2xpp2", "krizhevsky2014", "pp2xfs2"])
def test_parts_hold_each_tensor_once_and_rebuild_every_rank(name):
    """The actors' rank files (outputs.rank_files): the dp replicas of a position write its tensors once
    between them (bytes near one replica's), buffers from replica 0, the per-layer plan's dp slices each
    its own; every rank's payload rebuilt from the files equals its own, and joins to the same whole."""
    model, layers = model_layers()
    payloads, layout = saved(name, model, layers)
    buffers = {k for k, _ in model.named_buffers()}
    per_layer = layout["plan"] == "krizhevsky2014"
    files, written = [], 0
    for p in payloads:
        skeleton, entries = split_payload(p, buffers, per_layer)
        header, mine = rank_file_of(skeleton, entries, p["coord"][0], layout["dp"])
        written += sum(t.numel() * t.element_size() for t in mine.values())
        files.append(torch.load(io.BytesIO(_bytes({**header, "tensors": mine})), weights_only=True))
    def size(ps):
        return sum(t.numel() * t.element_size() for p in ps for _, _, t in entries_of(p))
    one_replica = size([p for p in payloads if p["coord"][0] == 0])
    if per_layer:   # (the FC layers' dp slices are distinct: all of them are written)
        assert written < size(payloads)
    else:
        assert written == one_replica, (written, one_replica)
    rebuilt = rank_payloads(files, layout)
    for got, want in zip(rebuilt, payloads):
        assert_payloads_equal(got, want)
    for k, v in join(payloads, layout)["model"].items():
        assert torch.equal(join(rebuilt, layout)["model"][k], v), k


def test_deal_gives_buffers_to_replica_0_and_balances_the_rest():
    sizes = {"a": (100, "shared"), "b": (60, "shared"), "c": (50, "shared"), "bn": (10, "buffer"),
             "x": (7, "own")}
    assert deal(sizes, 2) == {"bn": 0, "a": 1, "b": 0, "c": 0}
    assert deal(sizes, 1) == {"bn": 0, "a": 0, "b": 0, "c": 0}


def assert_payloads_equal(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_payloads_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_payloads_equal(g, w)
    else:
        assert got == want

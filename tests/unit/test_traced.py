"""The traced flat view (rayconv.models.traced) of a user's own ConvNets (tests/support/fixtures/blocks.py):
cuts where exactly one tensor is live, the pieces compute the model, state_dict keys are the user's."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from torch import fx, nn

from rayconv.config import Config
from rayconv.errors import LayoutError
from rayconv.mesh import Mesh
from rayconv.models import build_model, run_layers, to_layers
from rayconv.models import traced
from rayconv.models.traced import NotCuttable, cut_problem, traced_layers
from rayconv.outputs.export import assemble, export_model, state_keys
from rayconv.parallel.routing import make_routing

_SPEC = importlib.util.spec_from_file_location(
    "blocks_fixture",
    Path(__file__).parents[1] / "support" / "fixtures" / "blocks.py")
blocks = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(blocks)

# "": the gain's product (a GraphModule holding the model's own ``scale``); relu_1: torch.relu's piece.
BLOCKNET_LAYERS = ["conv1", "bn1", "relu", "layer1.0", "layer1.1", "", "relu_1", "pool", "flatten", "fc"]


def blocknet() -> nn.Module:
    torch.manual_seed(0)
    model = blocks.blocknet(10, 1).double()
    for m in model.modules():  # non-trivial statistics, so that eval mode uses them
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model


def test_cuts_are_the_block_boundaries():
    model = blocknet()
    layers = to_layers(model)
    assert [n for n, _ in layers] == BLOCKNET_LAYERS
    # Each piece is the user's own module (a block whole, skip inside), or holds the user's tensors.
    for name, m in layers:
        if name not in ("", "relu_1", "flatten"):
            assert m is model.get_submodule(name)
    pieces = dict(layers)
    assert isinstance(pieces["flatten"], nn.Flatten) and isinstance(pieces["relu_1"], nn.ReLU)
    assert isinstance(pieces[""], fx.GraphModule) and pieces[""].scale is model.scale


def test_no_cut_where_a_skip_is_live():
    """After the last node of every piece exactly one value is live; inside each block, from its first
    node to its sum, two or more are (the block's input, kept for the skip)."""
    model = blocknet()
    graph = traced._trace(model)
    calls = traced._module_calls(graph)
    pieces = traced._coarsen(model, traced._merge_tied(model, traced._split(graph)), calls)
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}

    def live_after(n):
        return sum(1 for v in nodes[:pos[n] + 1]
                   if v.op != "get_attr" and any(pos[u] > pos[n] for u in v.users))

    assert [live_after(p.nodes[-1]) for p in pieces] == [1] * len(BLOCKNET_LAYERS)
    for block in ("layer1.0", "layer1.1"):
        inside = sorted(calls[block][1], key=pos.get)
        adds = [n for n in inside if n.op == "call_function" and "add" in n.name]
        assert adds and all(live_after(n) >= 2 for n in inside[:inside.index(adds[0])])


@pytest.mark.parametrize("train", [False, True])
def test_pieces_compute_the_model(train):
    model = blocknet().train(train)
    layers = to_layers(model)
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        got = run_layers(layers, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_state_dict_keys_are_the_users(tmp_path):
    """Parts keyed as the actors key them (``f"{name}.{key}"``) assemble into a state_dict that loads
    into the user's class (export's strict check), with exactly the model's keys."""
    model = blocknet()
    layers = to_layers(model)
    parts = [{f"{n}.{k}" if n else k: v for n, m in layers[a:b] for k, v in m.state_dict().items()}
             for a, b in ((0, 4), (4, len(layers)))]
    state = assemble(parts, {})
    assert set(state) == set(model.state_dict())
    export_model(tmp_path / "model.pt", state, state_keys(blocks.BlockNet(10, 1).double()))
    fresh = blocks.BlockNet(10, 1).double()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k])


def test_tied_weights_stay_in_one_piece():
    model = blocks.tiednet(10, 4)
    layers = traced_layers(model)
    holders = [n for n, m in layers if any(p is model.first.weight for p in m.parameters())]
    assert len(holders) == 1
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(run_layers(layers, x), model(x), rtol=0, atol=0)
    got = {f"{n}.{k}" if n else k for n, m in layers for k in m.state_dict()}
    assert got == set(model.state_dict())


def test_untraceable_model_trains_data_parallel_and_is_refused_for_pp():
    model = blocks.branchy(10, 1)
    assert to_layers(model) == [("", model)]
    with pytest.raises(NotCuttable, match="torch.fx cannot trace its forward"):
        traced_layers(model)
    cfg = Config(model="convnet", data="digits", pp=2, dp=1, num_microbatches=2,
                 global_batch_size=8).validate()
    with pytest.raises(LayoutError) as e:
        make_routing(cfg, Mesh(dp=1, pp=2, fs=1), model, (1, 8, 8))
    msg = str(e.value)
    assert "\n" not in msg and "cannot be cut into pipeline stages (torch.fx cannot trace its forward" in msg
    assert "use --pp 1" in msg and len(msg) < 300
    assert cut_problem(model) in msg


def test_forward_reading_training_is_not_cut():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(nn.functional.dropout(self.a(x), 0.5, training=self.training))

    with pytest.raises(NotCuttable, match="reads self.training"):
        traced_layers(Drop())


@pytest.mark.parametrize("name, shape",
                         [("resnet18", (3, 32, 32)), ("alexnet", (3, 64, 64)), ("vgg11", (3, 32, 32))])
def test_torchvision_families_keep_their_block_list(name, shape):
    """ResNets, AlexNet and VGG take the traced view: their stem layers, blocks (features' children),
    pool, flatten and head in order, each the model's own module."""
    model = build_model(name, 10, shape[0], shape[1])
    layers = to_layers(model)
    if name == "resnet18":
        want = ["conv1", "bn1", "relu", "maxpool"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
        want += ["avgpool", "flatten", "fc"]
    else:
        want = [f"features.{n}" for n, _ in model.features.named_children()] + ["avgpool", "flatten"]
        want += [f"classifier.{n}" for n, _ in model.classifier.named_children()]
    assert [n for n, _ in layers] == want
    assert all(m is model.get_submodule(n) for n, m in layers if n != "flatten")


def test_non_persistent_buffer_stays_out_of_the_state():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(2, 2, 1), nn.Linear(2, 3)
            self.register_buffer("mask", torch.tensor([1.0, 0.0]).view(1, 2, 1, 1), persistent=False)
            self.register_buffer("gain", torch.full((1, 2, 1, 1), 2.0))

        def forward(self, x):
            return self.b(torch.flatten(self.a(x) * self.mask * self.gain, 1))

    model = Masked()
    layers = traced_layers(model)
    assert {f"{n}.{k}" if n else k for n, m in layers for k in m.state_dict()} == set(model.state_dict())
    x = torch.randn(2, 2, 1, 1)
    torch.testing.assert_close(run_layers(layers, x), model(x), rtol=0, atol=0)


def test_export_refuses_a_state_that_would_not_load_and_writes_nothing(tmp_path):
    """export_model's check is load_state_dict(strict=True)'s: a missing key, an unexpected one and a
    wrong shape are each named, and no model.pt is written."""
    model = blocks.BlockNet(10, 1).double()
    keys = state_keys(model)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    first, last = keys[0][0], keys[-1][0]
    bad_states = ({k: v for k, v in good.items() if k != last}, {**good, "extra.weight": torch.zeros(1)},
                  {**good, first: torch.zeros(3, 3)})
    for bad, word in zip(bad_states,
                         ("missing: " + last, "unexpected: extra.weight", f"shapes: {first} (3, 3)")):
        with pytest.raises(RuntimeError, match=re.escape(word)):
            export_model(tmp_path / "model.pt", bad, keys)
        with pytest.raises(RuntimeError):
            model.load_state_dict(bad, strict=True)   # (what a user's plain PyTorch would say too)
    assert not (tmp_path / "model.pt").exists()

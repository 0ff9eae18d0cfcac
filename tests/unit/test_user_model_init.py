"""``--init PATH`` without Ray: a model.pt or torchvision-format state_dict loads into the model with
every key and shape checked first (the first mismatch named in one line), ``--init-skip-head`` keeps
the classifier as built, and the flags' combinations are refused where they make no sense."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from rayconv.config import Config, ConfigError
from rayconv.data.registry import make_source
from rayconv.flags import resumed_settings
from rayconv.models import build_model, run_model
from rayconv.models.weights import head_keys, load_init, read_state

SPEC = f"{Path(__file__).resolve().parents[1] / 'support' / 'fixtures' / 'resnetish.py'}:ResNetish"


def saved(tmp_path, state, name="w.pt") -> str:
    torch.save(state, tmp_path / name)
    return str(tmp_path / name)


def test_run_model_starts_from_init_weights(tmp_path):
    """Every process builds the run's model as run_model does: with --init, the file's weights."""
    torch.manual_seed(5)
    trained = build_model(SPEC, 10, 1, 8)
    (tmp_path / "run").mkdir()
    torch.save(trained.state_dict(), tmp_path / "run" / "model.pt")
    cfg = Config(model=SPEC, init=str(tmp_path / "run")).validate()  # a run folder: its model.pt
    model = run_model(cfg, make_source(cfg))
    for k, v in trained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_torchvision_format_state_dicts_load(tmp_path):
    """A torchvision state_dict (also wrapped as {'model': ...} or DDP's module. prefix) loads into
    torchvision's builder; float32 weights go into a float64 model by value."""
    torch.manual_seed(0)
    src = torchvision.models.resnet18(num_classes=10)
    dst = build_model("resnet18", 10).double()
    for state in (src.state_dict(), {"model": src.state_dict(), "epoch": 3},
                  {f"module.{k}": v for k, v in src.state_dict().items()}):
        load_init(dst, saved(tmp_path, state))
        assert torch.equal(dst.fc.weight, src.fc.weight.double())


def test_first_mismatch_is_named(tmp_path):
    torch.manual_seed(0)
    model = build_model("resnet18", 10)
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    with pytest.raises(ConfigError, match=r"'fc.weight' has shape \(1000, 512\), the model's \(10, 512\); "
                                          r"for a new number of classes add --init-skip-head"):
        load_init(model, saved(tmp_path, state))
    bad = dict(state, **{"conv1.weight": torch.zeros(64, 3, 3, 3)})
    with pytest.raises(ConfigError,
                       match=r"'conv1.weight' has shape \(64, 3, 3, 3\), the model's \(64, 3, 7, 7\)$"):
        load_init(model, saved(tmp_path, bad), skip_head=True)
    with pytest.raises(ConfigError, match="has no 'layer4.1.bn2.num_batches_tracked'"):
        load_init(model, saved(tmp_path,
                               {k: v for k, v in state.items() if k != "layer4.1.bn2.num_batches_tracked"}))
    with pytest.raises(ConfigError, match="holds 'extra.weight', which the model has not"):
        load_init(model, saved(tmp_path, dict(state, **{"extra.weight": torch.zeros(1)})), skip_head=True)


def test_skip_head_keeps_the_classifier_as_built(tmp_path):
    torch.manual_seed(0)
    model = build_model("resnet18", 10)
    head = model.fc.weight.detach().clone()
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    assert head_keys(model) == ("fc.weight", "fc.bias")
    load_init(model, saved(tmp_path, state), skip_head=True)
    assert torch.equal(model.fc.weight, head) and torch.equal(model.conv1.weight, state["conv1.weight"])


@pytest.mark.parametrize("content, words", [
    (b"not a torch file", "cannot be read as a state_dict"),
    ([1, 2, 3], "holds no state_dict"),
    # a whole pickled model: torch's unpickler refuses it
    (torch.nn.Linear(2, 2), "cannot be read as a state_dict"),
])
def test_unreadable_files_are_refused(tmp_path, content, words):
    p = tmp_path / "w.pt"
    p.write_bytes(content) if isinstance(content, bytes) else torch.save(content, p)
    with pytest.raises(ConfigError, match=words):
        read_state(str(p))
    with pytest.raises(ConfigError, match="--init takes a run's model.pt") as e:
        read_state(str(p))
    assert "weights_only` set to `False`" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no such file"):
        read_state(str(tmp_path / "none.pt"))


def test_skip_head_needs_a_linear(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1))
    with pytest.raises(ConfigError, match="has no nn.Linear: drop --init-skip-head"):
        load_init(model, saved(tmp_path, model.state_dict()), skip_head=True)


@pytest.mark.parametrize("kw, words", [
    (dict(init_skip_head=True), "--init-skip-head applies to the weights of --init"),
    (dict(evaluate_only=True), "--evaluate-only applies to the weights of --init"),
    (dict(init="w.pt", resume="runs/r"), "give one of them"),
    (dict(init="w.pt", evaluate_only=True, init_skip_head=True), "drop --init-skip-head"),
])
def test_combinations_are_refused(kw, words):
    with pytest.raises(ConfigError, match=words):
        Config(**kw).validate()


def test_a_resumed_run_takes_its_weights_from_the_checkpoint():
    saved_cfg = Config(init="w.pt", init_skip_head=True, lr=0.1).to_dict()
    kept = resumed_settings(saved_cfg)
    assert (
        "init" not in kept
        and "init_skip_head" not in kept
        and "evaluate_only" not in kept
        and kept["lr"] == 0.1
    )


def test_float64_init_enters_a_float64_run_exactly(tmp_path):
    """An fp64 run's actors build the model in float64 (``run_model(..., dtype)``): --init's float64
    weights are its weights bit for bit (not rounded through the float32 model as built); without a
    dtype they are rounded to the built model's float32."""
    torch.manual_seed(5)
    trained = build_model(SPEC, 10, 1, 8).double()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # (values that float32 cannot hold)
    path = saved(tmp_path, trained.state_dict())
    cfg = Config(model=SPEC, init=path, precision="fp64").validate()
    model = run_model(cfg, make_source(cfg), torch.float64)
    for k, v in trained.state_dict().items():
        assert model.state_dict()[k].dtype == v.dtype and torch.equal(model.state_dict()[k], v), k
    fp32 = run_model(cfg, make_source(cfg))
    assert fp32.fc.weight.dtype == torch.float32 and torch.equal(fp32.fc.weight, trained.fc.weight.float())

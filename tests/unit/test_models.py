"""rayconv.models' flat layer views (to_layers, run_layers): the cut model computes the model itself."""

from __future__ import annotations

import pytest
import torch

from rayconv.models import ConvNet, build_model, run_layers, to_layers


@pytest.mark.parametrize("name, shape", [
    ("convnet", (1, 8, 8)),
    ("convnet-bn", (3, 32, 32)),
    ("alexnet", (3, 64, 64)),
    ("resnet18", (3, 32, 32)),
    ("vgg11", (3, 32, 32)),
])
def test_flat_layers_compute_the_model(name, shape):
    torch.manual_seed(0)
    if name == "convnet-bn":
        model = ConvNet(shape[0], 10, batch_norm=True)
    else:
        model = build_model(name, 10, shape[0], shape[1])
    model = model.double().eval()
    if name in ("convnet-bn", "resnet18"):
        # Non-trivial batch-norm statistics, so that eval mode actually uses them.
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    layers = to_layers(model)
    assert len(layers) > 1, "a known family must be cuttable"
    # The flat view holds the model's own parameters, all of them.
    flat_params = {id(p) for _, m in layers for p in m.parameters()}
    assert flat_params == {id(p) for p in model.parameters()}
    x = torch.randn(3, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        got = run_layers(layers, x)
    assert want.shape == (3, 10)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unknown_family_is_one_layer():
    model = torch.nn.Module()
    assert to_layers(model) == [("", model)]


@pytest.mark.parametrize("name, hint", [("mymodel.py", "--model mymodel.py:FUNCTION"),
                                        ("mypkg.mymodel", "--model mypkg:mymodel")])
def test_an_unknown_model_that_looks_like_ones_own_gets_the_form_to_give(name, hint):
    from rayconv.errors import ConfigError
    with pytest.raises(ConfigError, match=hint.replace(".", r"\.")):
        build_model(name, 10)

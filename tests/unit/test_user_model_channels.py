"""A user's own model on grey data, without Ray: the channels its FUNCTION is not told are found from
the model (``rayconv.models.channels``), a mismatch is refused naming ``--channels``, and the planner
measures such a model on the data it takes."""

from __future__ import annotations

import sys

import pytest
from torch import nn

from rayconv.config import Config, ConfigError
from rayconv.data.registry import make_source
from rayconv.driver.resolve import check_before_ray
from rayconv.flags import from_mapping
from rayconv.models.channels import first_convolution

GREY = """
from torch import nn

def build(num_classes=10, **kwargs):
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))

def make(num_classes):
    return build(num_classes)

def rgb(num_classes):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8,
    num_classes))

class HeadFirst(nn.Module):
    # defines its 3-channel head before its grey stem: the stem is the first convolution called
    def __init__(self, num_classes=10):
        super().__init__()
        self.head = nn.Conv2d(3, num_classes, 1)
        self.stem = nn.Conv2d(1, 3, 3, padding=1)

    def forward(self, x):
        return self.head(self.stem(x)).mean((2, 3))

def mlp(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
"""


@pytest.fixture
def grey_file(tmp_path, monkeypatch):
    """tmp_path/greynets.py (imported as module ``greynets``, forgotten afterwards with sys.path)."""
    (tmp_path / "greynets.py").write_text(GREY)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path / "greynets.py"
    sys.modules.pop("greynets", None)


@pytest.mark.parametrize("function, channels", [
    ("build", 1), ("make", 1),  # builders that do not name in_channels, Conv2d(1, ...) first
    ("rgb", 3),                 # Conv2d(3, ...) first: grey given as 3 equal channels
    ("HeadFirst", 1),           # the first convolution called, not the first defined
    ("mlp", 1),                 # no convolution: the data's own count, where a dry forward takes it
])
def test_grey_data_gets_the_channels_the_model_takes(grey_file, function, channels):
    src = make_source(Config(model=f"{grey_file}:{function}").validate())
    assert src.sample_shape == (channels, 8, 8) and bool(src.expanded_from) == (channels == 3)


def test_the_first_convolution_is_found_whatever_the_channels_given():
    model = nn.Sequential(nn.Identity(), nn.Conv2d(1, 4, 3), nn.Conv2d(4, 4, 3))
    for c in (1, 3):
        name, conv = first_convolution(model, (c, 8, 8))
        assert name == "1" and conv.in_channels == 1
    assert first_convolution(nn.Sequential(nn.Flatten(), nn.Linear(64, 2)), (1, 8, 8)) is None


@pytest.mark.parametrize(
    "function, channels, words",
    [
        (
            "build",
            3,
            r"takes 1-channel images \(first convolution '0': Conv2d\(1, \.\.\.\)\), given 3-channel ones: "
            r"give --channels 1$",
        ),
        ("rgb", 1, r"takes 3-channel images .*given 1-channel ones: give --channels 3$"),
    ],
)
def test_a_channel_mismatch_is_refused_naming_channels(grey_file, function, channels, words):
    cfg = Config(model=f"{grey_file}:{function}", channels=channels, device="cpu").validate()
    with pytest.raises(ConfigError, match=words):
        check_before_ray(cfg, None)


def test_fit_settings_take_the_same_channel_check(grey_file):
    """``rayconv.fit``'s settings (``flags.from_mapping``, as fit makes them) take the same check, which
    fit's run makes while its actors start: a grey model with --channels 3 refused in one line."""
    cfg = from_mapping({"model": f"{grey_file}:build", "channels": 3, "steps": 1, "device": "cpu"}).validate()
    with pytest.raises(ConfigError, match="takes 1-channel images.*give --channels 1"):
        check_before_ray(cfg, None)


def test_the_planner_measures_a_grey_model_on_the_grey_data(grey_file):
    """Synthetic ImageNet-shaped images have 3 channels: a user's model given the digits as 1 channel
    is measured on the digits, one given them as 3 on synthetic images (as torchvision's are)."""
    from rayconv.planner.search import plan_config

    assert plan_config(Config(model=f"{grey_file}:build").validate()).data == "digits"
    assert plan_config(Config(model=f"{grey_file}:rgb").validate()).data == "synthetic"

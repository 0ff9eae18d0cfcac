"""Refusals before Ray starts: every error line of a command starts with the same name, argparse's
included, and a model with lazy modules is told what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from rayconv.errors import ConfigError
from rayconv.models import check_trainable


@pytest.mark.parametrize("module, name", [("rayconv.run", "rayconv"), ("rayconv.plan", "rayconv.plan"),
                                          ("rayconv.prepare", "rayconv.prepare")])
def test_argparse_errors_start_as_the_commands_own(module, name):
    out = subprocess.run([sys.executable, "-m", module, "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"{name}: error: unrecognized arguments: --no-such-flag "
                                               "(--help lists the flags)"]


def test_lazy_modules_are_refused_with_their_fix():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(10))
    with pytest.raises(ConfigError, match=r"lazy modules \(LazyLinear\).*nn.Linear\(in_features"):
        check_trainable("net.py:Net", model, (3, 8, 8))
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    assert tuple(check_trainable("net.py:Net", eager, (3, 8, 8))) == (2, 10)

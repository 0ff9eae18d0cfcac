"""Layout names: every name the bench and planner use round-trips, refusals are one line."""

from __future__ import annotations

import pytest

from rayconv.errors import ConfigError
from rayconv.layout import Layout

NAMES = ["1gpu", "dp2", "fs2", "fs2c4", "pp2", "pp2m4", "pp2m4v2", "pp2m4-gpipe", "plan2", "dp2xfs2",
         "dp2xpp2m4v2-gpipe", "dp2xpp2m4xfs2c2", "pp2m2xfs4"]


@pytest.mark.parametrize("name", NAMES)
def test_names_round_trip(name):
    lay = Layout.parse(name)
    assert lay.name == name and Layout.parse(lay.name) == lay


def test_fields():
    assert Layout.parse("1gpu") == Layout() and Layout.parse("1") == Layout()
    assert Layout.parse("dp2xpp2m4v2-gpipe") == Layout(dp=2, pp=2, num_microbatches=4, schedule="gpipe",
                                                       virtual_stages=2)
    assert (
        Layout.parse("plan4") == Layout(dp=4, plan="krizhevsky2014") and Layout.parse("plan4").world_size == 4
    )
    assert Layout.parse("fs2c4").exchange_chunks == 4
    assert Layout.parse("pp2").num_microbatches is None and Layout.parse("pp2").num_microbatches_or_1 == 1
    assert Layout.parse("pp2m4-1f1b").name == "pp2m4"  # the default schedule is not named
    assert Layout.parse("dp2xpp2xfs2").mesh().shape == (2, 2, 2)


def test_config_fields_round_trip():
    from rayconv.config import Config

    for name in NAMES:
        lay = Layout.parse(name)
        cfg = Config(**lay.to_config_fields())
        back = Layout.from_config(cfg)
        assert back == Layout(**{**lay.__dict__, "num_microbatches": lay.num_microbatches_or_1})
    with pytest.raises(ValueError, match="resolved"):
        Layout.from_config(Config())  # dp left to the cluster


def test_layout_fields_are_declared_once():
    """Layout's fields are Config's layout flags (``LayoutFields``), in their order: none of its own."""
    from dataclasses import fields

    from rayconv.config import Config
    from rayconv.settings import LayoutFields

    names = [f.name for f in fields(LayoutFields)]
    assert [f.name for f in fields(Layout)] == names
    flags = {f.name: f for f in fields(Config)}
    assert all(flags[n].metadata["help"] for n in names)


@pytest.mark.parametrize("name, match", [
    ("tp2", "unknown layout"), ("pp2c4", "unknown layout"), ("dp2m4", "unknown layout"),
    ("fs2c0", "zero count"), ("dp0", "zero count"), ("pp2-zigzag", "unknown schedule"),
    ("dp2xdp4", "names dp twice"), ("dp2xplan2", "write it alone"), ("", "unknown layout")])
def test_refusals_are_one_line(name, match):
    with pytest.raises(ConfigError, match=match) as e:
        Layout.parse(name)
    assert "\n" not in str(e.value)

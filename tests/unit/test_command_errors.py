"""Refusals before Ray starts: every error line of a command starts with the same name, argparse's
included, and a model with lazy modules is told what to change; the usage names the command as started."""

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
    out = subprocess.run([sys.executable, "-m", module, "--no-such-flag"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"{name}: error: unrecognized arguments: --no-such-flag "
                                               "(--help lists the flags)"]


def test_lazy_modules_are_refused_with_their_fix():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(10))
    with pytest.raises(ConfigError, match=r"lazy modules \(LazyLinear\).*nn.Linear\(in_features"):
        check_trainable("net.py:Net", model, (3, 8, 8))
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    assert tuple(check_trainable("net.py:Net", eager, (3, 8, 8))) == (2, 10)


def test_a_model_name_missing_from_the_listing_is_refused_before_ray(tmp_path, monkeypatch, capsys,
                                                                     silent_address):
    """Where this machine listed torchvision's models (``models.model_names`` remembers the listing, per
    torchvision version), a mistyped name is refused before Ray is reached, in the line the model's own
    check gives; a listed name and, without a listing, any name go on to the cluster."""
    from rayconv import model_names as names
    from rayconv.models import build_model, model_names
    from rayconv.run import main

    monkeypatch.setenv("RAYCONV_CACHE_DIR", str(tmp_path / "cache"))
    names.check_known("resnet1000")   # (no listing yet: left to the model's check)
    listed = model_names()
    assert names.remembered() == listed[len(names.RAYCONV_MODELS):] and "resnet18" in listed
    names.check_known("resnet18")
    with pytest.raises(ConfigError) as built:
        build_model("resnet1000", 10)
    address, contacts = silent_address
    rc = main(["--address", address, "--model", "resnet1000", "--device", "cpu", "--steps", "1",
               "--out", str(tmp_path / "x")])
    assert rc == 2 and not contacts, "the cluster's address was reached"
    assert capsys.readouterr().err.strip() == f"rayconv: error: {built.value}"
    assert "resnet18" in str(built.value) and not (tmp_path / "x").exists()


def test_an_out_that_cannot_be_written_is_one_line_for_tune_and_prepare(tmp_path, capsys, silent_address):
    """rayconv.tune's and rayconv.prepare's --out under /proc or under a file: one line naming --out,
    exit 2, before the cluster is contacted (rayconv.run's: tests/unit/test_refusals.py)."""
    from rayconv.prepare import main as prepare
    from rayconv.tune.__main__ import main as tune

    address, contacts = silent_address
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    space = '{"lr": {"grid": [0.1]}}'
    commands = {"rayconv.tune": lambda out: tune(["--space", space, "--out", out, "--address", address,
                                                  "--steps", "1", "--device", "cpu"]),
                "rayconv.prepare": lambda out: prepare([str(tmp_path), "--out", out, "--address", address])}
    for out, said in (("/proc/rayconv-test-out", "cannot be written"), (str(blocker / "sub"), "is a file")):
        for name, command in commands.items():
            capsys.readouterr()
            rc = command(out)
            err = capsys.readouterr().err
            assert rc == 2 and err.startswith(f"{name}: error: --out {out}") and said in err, err
            assert len(err.strip().splitlines()) == 1, err
    assert not contacts and blocker.read_text() == "x"


@pytest.mark.parametrize("error, said", [
    (FloatingPointError("loss is nan at step 3: lower --lr (now 1e+30)"), "lower --lr"),
])
def test_a_diverged_run_exits_2(error, said, monkeypatch, capsys, tmp_path):
    """A loss that is not finite is the settings' (the training diverged: a lower --lr), exit status 2 as
    docs/running.md says for bad input; its line and the run's resume hint only (the run itself:
    tests/actors/test_bad_input.py)."""
    from rayconv.run import main

    def diverge(cfg, **kw):
        raise error

    monkeypatch.setattr("rayconv.api.start_and_train", diverge)
    assert main(["--out", str(tmp_path / "x"), "--steps", "4"]) == 2
    assert capsys.readouterr().err == f"rayconv: error: {error}\n" and said in str(error)


def test_an_errors_first_line():
    from rayconv.errors import first_line

    assert first_line(RuntimeError("System error: the node died\nTraceback ...")) == "the node died"
    assert first_line(OSError("\n  no such file\nmore")) == "no such file"
    assert first_line(KeyError()) == "KeyError"   # (no message: its type)


def test_the_usage_names_the_command_as_it_was_started(tmp_path):
    """``rayconv --help`` (the console script pip writes for ``[project.scripts]``, here one of the same
    form in a folder of its own) and ``python -m rayconv.run --help`` each name themselves."""
    script = tmp_path / "bin" / "rayconv"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport re\nimport sys\nfrom rayconv.run import main\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "    sys.exit(main())\n")
    script.chmod(0o755)
    for command, name in (([str(script)], "rayconv"), ([sys.executable, "-m", "rayconv.run"],
                                                         "python -m rayconv.run")):
        out = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: {name} [-h]"), out.stdout[:200]
    from rayconv.flags import command_name

    assert command_name("/home/u/.venv/bin/rayconv") == "rayconv"
    assert command_name("/home/u/rayconv/rayconv/run.py") == "python -m rayconv.run"   # (-m's argv[0])

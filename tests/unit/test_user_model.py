"""A user's own model (``--model MODULE:FUNCTION`` / ``path/to/file.py:FUNCTION`` / a callable given to
``rayconv.fit``), without Ray: the spec's parsing, every refusal (one line, exit 2, no cluster
contacted), what the actors are sent (``py_modules``, a pickled callable), and the Python API's checks
before Ray starts."""

from __future__ import annotations

import base64
import sys
import threading
from pathlib import Path

import pytest
import ray
import torch
from torch import nn

import rayconv
from rayconv.config import Config, ConfigError
from rayconv.driver.prestart import new_run_dir
from rayconv.driver.resolve import check_before_ray
from rayconv.models import build_model
from rayconv.user_model import (NAME_ENV, PICKLE_ENV, actor_runtime_env, model_label, model_name, parse_spec,
                                resolve, shipped_path)
from rayconv.run import main, parse_command_line

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "resnetish.py"
SPEC = f"{FIXTURE}:ResNetish"


@pytest.mark.parametrize("text, want", [
    ("mymodels.resnetish:ResNetish", ("mymodels.resnetish", None, "ResNetish")),
    ("path/to/resnetish.py:ResNetish", ("resnetish", "path/to/resnetish.py", "ResNetish")),
    ("resnetish.py:Outer.build", ("resnetish", "resnetish.py", "Outer.build")),
    ("torchvision.models:resnet18", ("torchvision.models", None, "resnet18")),
])
def test_spec_parsing(text, want):
    s = parse_spec(text)
    assert (s.module, s.path, s.function) == want


@pytest.mark.parametrize("text, words", [
    (":ResNetish", "both parts non-empty"),
    ("resnetish.py:", "both parts non-empty"),
    ("resnetish.py:Res-Net", "is not a Python name"),
    ("path/to/resnetish:ResNetish", "not a .py file"),
    ("path/to/my-model.py:ResNetish", "rename the file"),
    ("my-models.x:ResNetish", "neither a module name nor a .py file"),
])
def test_malformed_specs_are_refused(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_spec(text)


def test_model_from_a_file_keeps_its_class_and_parameter_names():
    """Built from the file's class: called with num_classes and in_channels (which it takes), not
    image_size (which it does not); its state_dict is the class's own, so model.pt loads into it."""
    model = build_model(SPEC, 7, in_channels=1, image_size=8)
    cls = resolve(SPEC)
    assert type(model) is cls and type(model).__module__ == "resnetish"
    assert model.stem[0].in_channels == 1 and model.fc.out_features == 7
    torch.manual_seed(0)
    fresh = cls(num_classes=7, in_channels=1)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 7)


def test_image_size_is_given_where_the_function_takes_it(tmp_path):
    f = tmp_path / "sized.py"
    f.write_text(
        "from torch import nn\n"
        "def build(num_classes, image_size, in_channels=3):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, num_classes))\n")
    model = build_model(f"{f}:build", 4, in_channels=3, image_size=5)
    assert model[1].in_features == 75


def test_grey_data_keeps_one_channel_where_the_function_takes_in_channels(tmp_path):
    """A user's FUNCTION told its channels gets the digits' one; one that is not gets 3 equal ones (a
    model made for RGB), as torchvision's do."""
    from rayconv.config import Config
    from rayconv.data.registry import make_source

    f = tmp_path / "flat.py"
    f.write_text("from torch import nn\n"
                 "def told(num_classes, in_channels=3):\n"
                 "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 64, num_classes))\n"
                 "def untold(num_classes):\n"
                 "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 64, num_classes))\n")
    assert make_source(Config(model=f"{f}:told").validate()).sample_shape == (1, 8, 8)
    assert make_source(Config(model=f"{f}:untold").validate()).sample_shape == (3, 8, 8)
    assert make_source(Config(model=f"{f}:told", channels=3).validate()).sample_shape == (3, 8, 8)
    sys.modules.pop("flat", None)


@pytest.mark.parametrize("spec, words", [
    ("no_such_module_xyz:build", "importing no_such_module_xyz failed"),
    ("tests/fixtures/missing.py:ResNetish", "no such file tests/fixtures/missing.py"),
    (f"{FIXTURE}:Nope", "has no 'Nope'"),
    (f"{FIXTURE}:ResNetish.nope", "ResNetish has no 'nope'"),
    (f"{FIXTURE}:NOT_CALLABLE", "is a int, not callable"),
])
def test_names_that_resolve_to_nothing_are_refused(spec, words):
    with pytest.raises(ConfigError, match=words):
        resolve(spec)


@pytest.mark.parametrize("function, words", [
    ("not_a_model", "returned dict, not an nn.Module"),
    ("no_classes", "takes no num_classes argument"),
    ("Block", "takes no num_classes argument"),
])
def test_functions_that_build_no_model_are_refused(function, words):
    with pytest.raises(ConfigError, match=words):
        build_model(f"{FIXTURE}:{function}", 10)


def test_a_function_that_raises_is_refused_naming_its_call(tmp_path):
    f = tmp_path / "raising.py"
    f.write_text("def build(num_classes):\n    raise ValueError('width must be even')\n")
    with pytest.raises(ConfigError, match=r"build\(num_classes=10\) raised ValueError: width must be even"):
        build_model(f"{f}:build", 10)


def test_a_module_that_fails_to_import_is_refused(tmp_path):
    (tmp_path / "needs_sibling.py").write_text("import sibling_blocks_xyz\ndef build(num_classes): pass\n")
    with pytest.raises(ConfigError,
                       match="sibling_blocks_xyz.*install the package that provides sibling_blocks_xyz"):
        resolve(f"{tmp_path / 'needs_sibling.py'}:build")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="raised RuntimeError: boom"):
        resolve(f"{tmp_path / 'broken.py'}:build")


def test_a_helper_module_beside_the_file_is_imported_and_shipped(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "layers_xyz.py").write_text("from torch import nn\ndef block(c): return nn.Conv2d(1, c, 3)\n")
    (tmp_path / "net_xyz.py").write_text("from layers_xyz import block\n"
                                         "def build(num_classes): return block(num_classes)\n")
    try:
        assert resolve(f"{tmp_path / 'net_xyz.py'}:build")(num_classes=2).out_channels == 2
        env = actor_runtime_env(f"{tmp_path / 'net_xyz.py'}:build")
        assert env == {"py_modules": [str(tmp_path / "layers_xyz.py"), str(tmp_path / "net_xyz.py")]}
    finally:
        sys.modules.pop("net_xyz", None), sys.modules.pop("layers_xyz", None)


@pytest.mark.parametrize(
    "source, words",
    [
        (
            "import timm_not_installed_pkg\n",
            r"No module named 'timm_not_installed_pkg' \(install the package that "
            r"provides timm_not_installed_pkg, e\.g\. `pip install timm_not_installed_pkg`",
        ),
        (
            "import helper_xyz.sub\n",
            r"'helper_xyz' is not a package \(helper_xyz is beside .*check that import\)",
        ),
        (
            "from .helper_xyz import x\n",
            r"no known parent package \(a file given by its path is imported as a top-level "
            r"module: import the modules beside it by name",
        ),
    ],
)
def test_an_import_that_fails_gets_the_advice_of_its_cause(tmp_path, monkeypatch, source, words):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "helper_xyz.py").write_text("x = 1\n")
    (tmp_path / "imports_xyz.py").write_text(source + "def build(num_classes): pass\n")
    try:
        with pytest.raises(ConfigError, match=words) as e:
            resolve(f"{tmp_path / 'imports_xyz.py'}:build")
        assert "PACKAGE.MODULE" not in str(e.value)
    finally:
        sys.modules.pop("helper_xyz", None)


def test_a_relative_import_in_a_package_names_the_package_spec(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "net", raising=False)   # (another test's model file of that name)
    (tmp_path / "pkg_xyz").mkdir()
    (tmp_path / "pkg_xyz" / "__init__.py").write_text("")
    (tmp_path / "pkg_xyz" / "net.py").write_text("from . import other\ndef build(num_classes): pass\n")
    with pytest.raises(ConfigError,
                       match=r"its folder is a package: give --model pkg_xyz\.net:build from the folder"):
        resolve(f"{tmp_path / 'pkg_xyz' / 'net.py'}:build")


def test_a_file_shadowing_another_module_is_refused(tmp_path):
    (tmp_path / "tabnanny.py").write_text("def build(num_classes): pass\n")
    with pytest.raises(ConfigError, match="shadow the standard module 'tabnanny'"):
        resolve(f"{tmp_path / 'tabnanny.py'}:build")
    other = tmp_path / "other"
    other.mkdir()
    (other / "resnetish.py").write_text("def build(num_classes): pass\n")
    resolve(SPEC)  # resnetish is imported from the fixture
    with pytest.raises(ConfigError, match="already imported from"):
        resolve(f"{other / 'resnetish.py'}:build")


def test_unknown_dotted_name_hints_at_the_colon():
    with pytest.raises(ConfigError, match=r"your own model\? --model mymodels\.resnetish:ResNetish"):
        build_model("mymodels.resnetish.ResNetish", 10)


# Refused by the command line in one line with exit 2, before any cluster is contacted.
CLI_CASES = {
    "missing file": (["--model", "tests/fixtures/missing.py:ResNetish"], "no such file"),
    "no function": (["--model", f"{FIXTURE}:Nope"], "has no 'Nope'"),
    "not callable": (["--model", f"{FIXTURE}:NOT_CALLABLE"], "not callable"),
    "init missing": (["--init", "{tmp}/none.pt"], "no such file"),
    "skip without init": (["--init-skip-head"], "add it"),
    "evaluate without init": (["--evaluate-only"], "--evaluate-only applies to the weights of --init"),
}


# Refused by the check a run makes while its actors start (``check_before_ray``): in one line, an
# error the command exits 2 with (tests/actors/test_bad_input.py: such a refusal leaves nothing behind).
LATE_CASES = {
    "not a module": (["--model", f"{FIXTURE}:not_a_model"], "not an nn.Module"),
    "tuple out": (["--model", f"{FIXTURE}:resnetish_tuple"], "returns tuple when training"),
    "classes ignored": (
        ["--model", f"{FIXTURE}:ignores_classes"],
        "gives 1000 class scores, the data has 10",
    ),
}


@pytest.mark.parametrize("case", list(LATE_CASES))
def test_refused_by_the_check_without_cluster(case, tmp_path):
    flags, words = LATE_CASES[case]
    connected = ray.is_initialized()
    cfg = parse_command_line(["--device", "cpu", "--steps", "1", "--out", str(tmp_path / "out"), *flags])
    with pytest.raises(ConfigError) as e:
        check_before_ray(cfg, None)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    assert ray.is_initialized() == connected and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_refused_before_ray(case, tmp_path, capsys, silent_address):
    address, contacts = silent_address
    flags, words = CLI_CASES[case]
    connected = ray.is_initialized()
    capsys.readouterr()
    rc = main(["--address", address, "--device", "cpu", "--steps", "1", "--no-progress",
               "--out", str(tmp_path / "out"), *[f.replace("{tmp}", str(tmp_path)) for f in flags]])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("rayconv: error: "), lines
    assert words in lines[0], lines[0]
    assert not contacts and ray.is_initialized() == connected
    assert not (tmp_path / "out").exists()


def test_the_actors_get_the_users_file_in_py_modules():
    env = actor_runtime_env(SPEC, {"X": "1"})
    # (with any other module imported here from the file's folder: tests/fixtures/blocks.py by an earlier
    # test)
    assert env["env_vars"] == {"X": "1"} and str(FIXTURE) in env["py_modules"]
    assert all(Path(p).parent == FIXTURE.parent for p in env["py_modules"]) and set(env) == {
        "env_vars",
        "py_modules",
    }
    assert actor_runtime_env("convnet") is None and actor_runtime_env("resnet18", {"X": "1"}) == {
        "env_vars": {"X": "1"}
    }
    # installed packages, the standard library and rayconv itself are not shipped
    assert actor_runtime_env("torchvision.models:resnet18") is None
    assert shipped_path("json") is None and shipped_path("rayconv.models") is None and shipped_path(
        "torch") is None


def test_a_package_is_shipped_as_its_folder(tmp_path, monkeypatch):
    pkg = tmp_path / "mymodels_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(
        "from torch import nn\ndef build(num_classes): return nn.Linear(3, num_classes)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(build_model("mymodels_pkg.nets:build", 5), nn.Linear)
    assert actor_runtime_env("mymodels_pkg.nets:build") == {"py_modules": [str(pkg)]}


def test_run_folder_and_label_of_a_spec():
    assert model_label(SPEC) == "ResNetish" and model_label("resnet18") == "resnet18"
    cfg = Config(model="tests/support/fixtures/resnetish.py:ResNetish").validate()
    assert new_run_dir(cfg).parent == Path("runs") and new_run_dir(cfg).name.endswith("-ResNetish-digits")


# ---------------------------------------------------------------------- callables (the Python API)
def test_an_importable_callable_runs_by_its_name():
    cls = resolve(SPEC)
    assert model_name(cls) == "resnetish:ResNetish"
    assert model_name("convnet") == "convnet"
    assert actor_runtime_env("resnetish:ResNetish") == {"py_modules": [str(FIXTURE)]}


def test_a_lambda_is_pickled_for_the_actors(monkeypatch):
    """A lambda is registered under its module and name; the actors get its pickle (and the user's
    module it refers to); an actor process (no registry, only the environment) builds the same model."""
    cls = resolve(SPEC)
    name = model_name(lambda num_classes: cls(num_classes=num_classes, width=4))
    assert name == f"{__name__}:test_a_lambda_is_pickled_for_the_actors.<locals>.<lambda>"
    env = actor_runtime_env(name)
    assert env["env_vars"][NAME_ENV] == name and str(FIXTURE) in env["py_modules"]
    from rayconv import user_model as user

    monkeypatch.delitem(user._BY_VALUE, name)
    monkeypatch.setenv(NAME_ENV, name)
    monkeypatch.setenv(PICKLE_ENV, env["env_vars"][PICKLE_ENV])
    model = build_model(name, 3)
    assert type(model) is cls and model.fc.in_features == 8 and model.fc.out_features == 3
    base64.b64decode(env["env_vars"][PICKLE_ENV])


def test_unpicklable_callables_and_built_models_are_refused():
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="cannot be pickled for the actors"):
        model_name(lambda num_classes: (lock, nn.Linear(3, num_classes))[1])
    cls = resolve(SPEC)
    with pytest.raises(
        ConfigError, match=r"is a built model: give the function or class that builds it \(model=ResNetish\)"
    ):
        model_name(cls())
    with pytest.raises(ConfigError, match="give a model name"):
        model_name(3)


def test_fit_refuses_bad_settings_before_ray():
    connected = ray.is_initialized()
    with pytest.raises(ConfigError, match="--lr must be > 0"):
        rayconv.fit(lr=-1, steps=2)
    with pytest.raises(ConfigError, match="unknown setting"):
        rayconv.fit(Config(), learning_rate=0.1)
    with pytest.raises(ConfigError, match="a rayconv.Config or None"):
        rayconv.fit({"lr": 0.1})
    with pytest.raises(ConfigError, match="is a built model"):
        rayconv.fit(model=nn.Linear(3, 3))
    with pytest.raises(ConfigError, match="no such file"):
        rayconv.fit(model="tests/fixtures/missing.py:ResNetish", steps=1, device="cpu", log=lambda *_: None)
    assert ray.is_initialized() == connected


def test_fit_refuses_before_ray_in_a_fresh_process():
    """``rayconv.fit(lr=-1, steps=2)`` raises ConfigError at once: Ray is neither started nor imported."""
    import subprocess

    code = ("import sys, rayconv\ntry:\n    rayconv.fit(lr=-1, steps=2)\nexcept rayconv.ConfigError as e:\n"
            "    print(type(e).__name__, 'ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ConfigError False", out.stderr[-2000:]

"""A user's own model: ``--model MODULE:FUNCTION``, ``--model path/to/file.py:FUNCTION``, or a callable
given to ``rayconv.fit(model=...)``.

FUNCTION (a function or a class, a dotted attribute path inside the module) is called as
``FUNCTION(num_classes=K)``, with ``in_channels`` and ``image_size`` added where its signature names
them, and must return an ``nn.Module``. A file given by its path is imported as the module named by its
stem (``resnetish.py`` -> ``resnetish``), its folder first on ``sys.path`` as for a script (``from layers
import block`` imports ``layers.py`` beside it); other imports must be installed.

The actors need not have the user's code installed: ``actor_runtime_env`` names, for Ray's runtime
environment, the user's modules to ship (``py_modules``: a package's folder or a single ``.py`` file,
shipped once and put on every actor's ``sys.path``, on every node: ``cluster.ship``; for a file given by
its path, the modules imported from its folder too: a node need not share the driver's file system) and, for
a callable that
cannot be imported by name (a lambda, a local function, one of ``__main__``), its cloudpickle in an
environment variable. Every process then builds the model from the same string (``resolve``). Errors a user
can fix raise ConfigError in one line naming ``--model``.

This module imports torch only to build a model or to check one given to ``rayconv.fit``: the driver
names the model and sets up the actors' runtime environment (``actor_runtime_env``) before it imports
torch (``driver.early.start_first``).
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import inspect
import io
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from rayconv.errors import ConfigError, first_line

if TYPE_CHECKING:
    from torch import nn

NAME_ENV = "RAYCONV_MODEL_NAME"      # the pickled callable's model name (on the actors)
PICKLE_ENV = "RAYCONV_MODEL_PICKLE"  # its cloudpickle, base64
MAX_PICKLE_BYTES = 64 * 1024         # an environment variable holds at most 128 KiB on Linux
SPEC_FORM = "MODULE:FUNCTION or path/to/file.py:FUNCTION"
OPTIONAL_ARGS = ("in_channels", "image_size")
_BY_VALUE: dict[str, Callable] = {}  # model name -> callable given to rayconv.fit, not importable by name


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model`` spec: the module to import (a path's stem for a file), the ``.py`` file
    (None for a module name), the dotted attribute path of the function inside the module."""

    text: str
    module: str
    path: Optional[str]
    function: str


def is_user_model(name: str) -> bool:
    """Whether ``--model name`` is a user's model (a spec with ``:``, or a callable given to fit)."""
    return ":" in name or name in _BY_VALUE


def parse_spec(text: str) -> ModelSpec:
    """``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION`` (split at the last ``:``). Raises ConfigError
    for an empty or malformed part."""
    left, _, function = text.rpartition(":")
    bad = f"--model {text!r}: give {SPEC_FORM}"
    if not left or not function:
        raise ConfigError(f"{bad} (both parts non-empty)")
    if not all(part.isidentifier() for part in function.split(".")):
        raise ConfigError(f"{bad}: {function!r} is not a Python name")
    if left.endswith(".py") or "/" in left or os.sep in left:
        if not left.endswith(".py"):
            raise ConfigError(f"{bad}: {left!r} is a path but not a .py file")
        stem = Path(left).stem
        if not stem.isidentifier():
            raise ConfigError(f"{bad}: the file {left!r} is imported as module {stem!r}, which is not a "
                              "Python name: rename the file")
        return ModelSpec(text, stem, left, function)
    if not all(part.isidentifier() for part in left.split(".")):
        raise ConfigError(f"{bad}: {left!r} is neither a module name nor a .py file")
    return ModelSpec(text, left, None, function)


def resolve(name: str) -> Callable:
    """The callable that ``--model name`` names: a callable given to fit in this process, else one
    shipped pickled to this actor, else FUNCTION of the imported module. Raises ConfigError."""
    if name in _BY_VALUE:
        return _BY_VALUE[name]
    if os.environ.get(NAME_ENV) == name:
        _BY_VALUE[name] = _unpickle(os.environ[PICKLE_ENV])
        return _BY_VALUE[name]
    spec = parse_spec(name)
    obj: Any = _import(spec)
    for i, attr in enumerate(spec.function.split(".")):
        if not hasattr(obj, attr):
            where = spec.path or spec.module
            inside = ".".join(spec.function.split(".")[:i]) or where
            raise ConfigError(
                f"--model {name}: {inside} has no {attr!r}: name a function or class of {where}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ConfigError(f"--model {name}: {spec.function} is a {type(obj).__name__}, not callable: name a "
                          "function or class that returns an nn.Module")
    return obj


def _import(spec: ModelSpec) -> types.ModuleType:
    """The module of ``spec``: a file by its path where it exists here (registered as its stem), else
    the module by name (on an actor: the copy shipped in ``py_modules``). Raises ConfigError."""
    try:
        if spec.path is None or not Path(spec.path).is_file():
            if spec.path is not None and importlib.util.find_spec(spec.module) is None:
                raise ConfigError(f"--model {spec.text}: no such file {spec.path}")
            return importlib.import_module(spec.module)
        path = Path(spec.path).resolve()
        held = sys.modules.get(spec.module)
        if held is not None:
            if getattr(held, "__file__", None) and Path(held.__file__).resolve() == path:
                return held
            raise ConfigError(f"--model {spec.text}: a module named {spec.module!r} is already imported from "
                              f"{getattr(held, '__file__', 'elsewhere')}: rename {spec.path}")
        if spec.module in sys.stdlib_module_names:
            raise ConfigError(f"--model {spec.text}: {spec.path} would shadow the standard module "
                              f"{spec.module!r}: rename the file")
        folder = str(path.parent)
        if folder not in sys.path:  # (as Python runs a script: the modules beside the file import by name)
            sys.path.insert(0, folder)
        loader = importlib.util.spec_from_file_location(spec.module, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[spec.module] = module
        try:
            loader.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.module]
            raise
        return module
    except ModuleNotFoundError as e:
        raise ConfigError(f"--model {spec.text}: importing {spec.path or spec.module} failed: {e}"
                          f"{_missing_advice(spec, e.name or '')}") from None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        relative = ""
        if spec.path and isinstance(e, ImportError) and "no known parent package" in str(e):
            folder = Path(spec.path).resolve().parent
            relative = (
                f" (its folder is a package: give --model {folder.name}.{spec.module}:{spec.function} from "
                "the folder above it)"
                if (folder / "__init__.py").is_file()
                else (
                    " (a file given by its path is imported as a top-level module: import the modules beside"
                    " it by name, `from layers import ...`)"
                )
            )
        raise ConfigError(f"--model {spec.text}: importing {spec.path or spec.module} raised "
                          f"{type(e).__name__}: {first_line(e)}{relative}") from None


def _missing_advice(spec: ModelSpec, missing: str) -> str:
    """What to do about ``missing``, the module a ModuleNotFoundError names while importing ``spec``'s
    module: the spec's own module not found (check the name), a module beside the file (check that
    import), else a package to install."""
    top = missing.split(".")[0]
    if spec.path is None and top == spec.module.split(".")[0]:
        return f" (is {top} installed, or its folder on PYTHONPATH? a file: give path/to/file.py:FUNCTION)"
    folder = Path(spec.path).resolve().parent if spec.path and Path(spec.path).is_file() else None
    if folder is not None and ((folder / f"{top}.py").is_file() or (folder / top).is_dir()):
        return f" ({top} is beside {spec.path}: check that import)"
    return (
        f" (install the package that provides {top}, e.g. `pip install {top}`, into the Python environment "
        "rayconv runs in, on every node)")


def build_user_model(name: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """``FUNCTION(num_classes=..., [in_channels=...], [image_size=...])`` (see the module docstring).
    Raises ConfigError when the function cannot take ``num_classes``, raises, or returns no nn.Module."""
    from torch import nn

    fn = resolve(name)
    kwargs: dict[str, Any] = {"num_classes": num_classes}
    params = _parameters(fn)
    if params is not None:
        named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if "num_classes" not in named and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise ConfigError(f"--model {name}: {_label(fn)} takes no num_classes argument: rayconv calls it "
                              "as FUNCTION(num_classes=K[, in_channels=C][, image_size=S])")
        kwargs.update({k: v for k, v in (("in_channels", in_channels), ("image_size", image_size))
                       if k in named})
    try:
        model = fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's builder raised
        args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        raise ConfigError(
            f"--model {name}: {_label(fn)}({args}) raised {type(e).__name__}: {first_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name}: {_label(fn)} returned {type(model).__name__}, not an nn.Module: "
                          "name a function or class that builds the model")
    return model


def _parameters(fn: Callable) -> Optional[Any]:
    """``fn``'s signature parameters, None for a builtin without a signature (then num_classes only)."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def takes_in_channels(name: str) -> bool:
    """Whether the user's FUNCTION names an ``in_channels`` argument (it is then given the data's own
    channel count, grey included). Raises ConfigError as ``resolve`` does."""
    params = _parameters(resolve(name))
    return params is not None and "in_channels" in params


def model_name(model: Any) -> str:
    """The ``--model`` string of what ``rayconv.fit(model=...)`` was given: a string as it is; a callable
    importable by its module and name as ``module:qualname``; any other callable registered under
    ``module:qualname`` for this process and pickled for the actors. Raises ConfigError for a built
    model, a non-callable, or a callable cloudpickle cannot pickle (or over ``MAX_PICKLE_BYTES``)."""
    if isinstance(model, str):
        return model
    from torch import nn

    if isinstance(model, nn.Module):
        raise ConfigError(f"model={type(model).__name__}(...) is a built model: give the function or class "
                          f"that builds it (model={type(model).__name__}), which every actor calls")
    if not callable(model):
        raise ConfigError(
            f"model={model!r}: give a model name, {SPEC_FORM}, or a callable returning an nn.Module")
    module, qualname = getattr(model, "__module__", None), getattr(model, "__qualname__", None)
    if module and qualname and module != "__main__" and "<" not in qualname and _lookup(module,
                                                                                        qualname) is model:
        return f"{module}:{qualname}"
    name = f"{module or 'callable'}:{qualname or type(model).__name__}"
    _pickled(model, name)
    _BY_VALUE[name] = model
    return name


def _lookup(module: str, qualname: str) -> Any:
    try:
        obj: Any = importlib.import_module(module)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
        return obj
    except Exception:  # noqa: BLE001 - not importable by name
        return None


def _pickled(fn: Callable, name: str) -> tuple[bytes, set[str]]:
    """(``fn``'s cloudpickle, the modules it refers to by reference). Raises ConfigError in one line."""
    # (ray.cloudpickle is the serializer Ray uses; imported here to keep Ray off this module's import)
    from ray import cloudpickle

    class Recorder(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, types.ModuleType):
                modules.add(obj.__name__)
            elif isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
                modules.add(getattr(obj, "__module__", None) or "builtins")
            return super().reducer_override(obj)

    modules: set[str] = set()
    buf = io.BytesIO()
    try:
        Recorder(buf).dump(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the user's to fix
        raise ConfigError(
            f"model={name}: the callable cannot be pickled for the actors ({type(e).__name__}: "
            f"{first_line(e)}): define it at the top level of a module and give that") from None
    if buf.tell() > MAX_PICKLE_BYTES:
        raise ConfigError(f"model={name}: the callable pickles to {buf.tell() // 1024} KiB (over "
                          f"{MAX_PICKLE_BYTES // 1024} KiB: it holds data): define it in a module and give "
                          "MODULE:FUNCTION")
    return buf.getvalue(), modules


def _unpickle(text: str) -> Callable:
    # (ray.cloudpickle, as in _pickled)
    from ray import cloudpickle

    return cloudpickle.loads(base64.b64decode(text))


def actor_runtime_env(name: str, env_vars: Optional[dict[str, str]] = None) -> Optional[dict[str, Any]]:
    """Ray's ``runtime_env`` for the actors of a run of ``--model name``: ``env_vars`` plus, for a user's
    model, the user's modules in ``py_modules`` (those not installed: outside site-packages and the
    standard library, and not rayconv) and a by-value callable's pickle. None when there is nothing."""
    env: dict[str, Any] = {"env_vars": dict(env_vars or {})}
    if is_user_model(name):
        if name in _BY_VALUE:
            blob, modules = _pickled(_BY_VALUE[name], name)
            env["env_vars"].update({NAME_ENV: name, PICKLE_ENV: base64.b64encode(blob).decode()})
        else:
            spec = parse_spec(name)
            resolve(name)  # (imported here first: the modules it imports from its folder are then known)
            modules = {spec.module} | (beside(Path(spec.path).resolve().parent) if spec.path else set())
        ship = sorted({p for p in map(shipped_path, modules) if p is not None})
        if ship:
            env["py_modules"] = ship
    if not env["env_vars"]:
        del env["env_vars"]
    return env or None


def beside(folder: Path) -> set[str]:
    """The top-level modules imported in this process from ``folder`` (a ``.py`` file or a package there)."""
    found = set()
    for name, mod in sys.modules.copy().items():   # (a copy taken at once: other threads import)
        if "." in name or mod is None:
            continue
        paths = list(getattr(mod, "__path__", None) or [])  # (a package: its folders; a module: its file)
        where = [Path(p).parent for p in paths] if paths else \
            [Path(mod.__file__).parent] if getattr(mod, "__file__", None) else []
        if any(p.resolve() == folder for p in where):
            found.add(name)
    return found


def shipped_path(module: str) -> Optional[str]:
    """The folder (package) or ``.py`` file to ship for ``module``'s top-level package, or None when it
    is installed (site-packages, the standard library), is rayconv, or has no single location."""
    top = module.split(".")[0]
    if top in ("rayconv", "__main__", "builtins") or top in sys.stdlib_module_names:
        return None
    mod = sys.modules.get(top)
    if mod is None:
        found = importlib.util.find_spec(top)
        if found is None:
            return None
        locations = list(found.submodule_search_locations or []) or [found.origin]
    else:
        locations = list(getattr(mod, "__path__", []) or []) or [getattr(mod, "__file__", None)]
    if len(locations) != 1 or not locations[0] or not os.path.exists(locations[0]):
        return None
    where = Path(locations[0]).resolve()
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(part in ("site-packages", "dist-packages") for part in where.parts) or \
            any(where.is_relative_to(p) for p in prefixes):
        return None
    return str(where)


def model_label(name: str) -> str:
    """A short file-name-safe label of ``--model name`` (a run folder's name): the function's name for
    a user's model, the name itself otherwise."""
    if not is_user_model(name):
        return name
    label = name.rpartition(":")[2].rpartition(".")[2]
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label) or "model"


def _label(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__

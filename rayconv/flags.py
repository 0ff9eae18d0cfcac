"""The command-line and JSON form of :class:`rayconv.config.Config`: one flag per field.

``build_parser`` makes ``--global-batch-size`` of ``global_batch_size`` (booleans as ``--x/--no-x``),
with each field's help text and choices, its usage naming the command as started (``command_name``);
``read_settings`` puts the flags over a ``--config`` JSON file; ``from_mapping`` checks each value's type
against its field (JSON gives any type) and builds the Config; ``parse_args`` validates it.
``resumed_settings`` picks what a ``--resume`` run takes over from its checkpoint. Errors a user can cause
raise ConfigError naming the flag; argparse's own errors are one line and exit 2 (``OneLineParser``).
Imports only ``config``, ``data_dir`` and ``errors``, so the command lines stay free of torch and Ray
until their arguments are known to be good.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

from rayconv.config import Config
from rayconv.data_dir import with_data_kind
from rayconv.errors import ConfigError

# Settings a resumed run does not take over from its checkpoint: where it runs and writes.
NOT_RESUMED = ("out", "resume", "address")
# Settings of how a run started, which its checkpoint's weights replace when it is resumed.
STARTING_POINT = ("init", "init_skip_head", "evaluate_only")


def flag(name: str) -> str:
    """The flag of a Config field: ``global_batch_size`` -> ``--global-batch-size``."""
    return "--" + name.replace("_", "-")


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (not the whole usage block) and exit 2, starting
    ``<error_name>: error:`` as the command's own checks' errors do (default: the program's name).
    Flags are taken only whole (``allow_abbrev=False``): ``--step 20`` is refused, not read as ``--steps``."""

    def __init__(self, *args: Any, error_name: Optional[str] = None, **kw: Any):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)
        self.error_name = error_name or self.prog

    def error(self, message: str):
        self.exit(2, f"{self.error_name}: error: {message}{self._suggestion(message)} "
                     "(--help lists the flags)\n")

    def _suggestion(self, message: str) -> str:
        """``; did you mean --steps?`` for an unrecognized flag close to a known one (difflib), else ''."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        unknown = [w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
        return closest_flags(unknown, known)


def closest_flags(unknown: list[str], known: list[str]) -> str:
    """``; did you mean --steps?`` naming the flag of ``known`` closest to each of ``unknown`` (difflib),
    or '' where none is close."""
    close = [m for w in unknown for m in difflib.get_close_matches(w, known, n=1, cutoff=0.75)]
    return f"; did you mean {', '.join(close)}?" if close else ""


def command_name(argv0: Optional[str] = None) -> str:
    """The command as the user typed it, for the usage line: ``rayconv`` where ``argv0`` (default
    ``sys.argv[0]``) is the console script (pyproject.toml's ``[project.scripts]``: ``.../bin/rayconv``),
    else ``python -m rayconv.run`` (the module, also a script or a Python caller of ``run.main``)."""
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    return "rayconv" if name in ("rayconv", "rayconv.exe") else "python -m rayconv.run"


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one flag per Config field (defaults left unset to detect what was given),
    its usage line naming the command as started (``command_name``)."""
    p = OneLineParser(prog=command_name(), error_name="rayconv",
                      description="Train a ConvNet with synchronous SGD across Ray actors (data parallel, "
                                  "pipeline, filter split).", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="JSON file of settings (e.g. a run's config.json); flags override it")
    for f in fields(Config):
        meta = dict(f.metadata)
        text = meta.get("help", "")
        kw: dict[str, Any] = {"help": text if "default" in text else f"{text} (default: {f.default})"}
        if f.type in ("bool", bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _parse_type(f.type)
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        p.add_argument(flag(f.name), dest=f.name, **kw)
    return p


def _parse_type(t: Any):
    t = str(t)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def from_mapping(values: dict[str, Any]) -> Config:
    """Config from a dict; unknown keys raise ConfigError naming them, as do values of the wrong type.
    Without ``data``, a ``data_dir`` gives it (``rayconv.data_dir.with_data_kind``)."""
    known = {f.name: f for f in fields(Config)}
    problem = unknown_settings(values)
    if problem:
        raise ConfigError(problem)
    values = with_data_kind(values)   # --data-dir alone: the data kind the folder holds
    if isinstance(values.get("compile"), bool):  # configs written before --compile took auto/on/off
        values = {**values, "compile": "on" if values["compile"] else "off"}
    for key, v in values.items():  # JSON gives any type: check each against the field's
        t = str(known[key].type)
        ok = (v is None and "Optional" in t) or (
            isinstance(v, bool) if "bool" in t else
            isinstance(v, int) and not isinstance(v, bool) if "int" in t else
            isinstance(v, (int, float)) and not isinstance(v, bool) if "float" in t else isinstance(v, str))
        if not ok:
            raise ConfigError(f"setting {key} = {v!r} has the wrong type: {flag(key)} takes "
                              f"{t.replace('Optional[', '').rstrip(']')}")
    return Config(**values)


def unknown_settings(values: dict[str, Any]) -> Optional[str]:
    """What is wrong with the keys of ``values`` that name no setting (None when all do): each with the
    closest setting's name (difflib, as ``closest_flags`` for flags), else where the names are listed."""
    known = [f.name for f in fields(Config)]
    unknown = sorted(set(values) - set(known))
    if not unknown:
        return None
    close = [m for w in unknown for m in difflib.get_close_matches(w, known, n=1, cutoff=0.75)]
    hint = f"did you mean {', '.join(close)}?" if close else "python -m rayconv.run --help lists them"
    return f"unknown setting(s) {', '.join(unknown)} (the flags' names, - as _): {hint}"


def read_settings(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """The settings of a command line: its flags over its ``--config`` file's (the file's output folder,
    checkpoint and cluster address left out), unchecked. Raises ConfigError; argparse exits 2 on a
    malformed flag."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    cfg_file = ns.pop("config", None)
    if cfg_file is not None:
        path = Path(cfg_file)
        if not path.is_file():
            raise ConfigError(f"--config {cfg_file}: no such file")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {cfg_file} is not valid JSON ({e}): fix the file") from None
        if not isinstance(values, dict):
            raise ConfigError(f"--config {cfg_file} must hold a JSON object of settings")
        problem = unknown_settings(values)
        if problem:
            raise ConfigError(f"--config {cfg_file}: {problem}")
        # A run's config.json names its output folder (and checkpoint, cluster): a re-run is a new run,
        # into a new folder, unless flags say otherwise.
        for key in NOT_RESUMED:
            values.pop(key, None)
    return {**values, **ns}


def parse_args(argv: Optional[list[str]] = None) -> Config:
    """The validated Config of a command line (``read_settings``). ``--resume``'s checkpoint settings
    are not read here: ``rayconv.run`` puts them under the flags. Raises ConfigError."""
    return from_mapping(read_settings(argv)).validate()


def resumed_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """Of the settings saved in a checkpoint (its manifest's ``config``), those a resumed run takes
    over (flags given override them; the output folder defaults to the checkpoint's run folder; the
    weights come from the checkpoint, not from the run's --init)."""
    known = {f.name for f in fields(Config)}
    return {k: v for k, v in saved.items() if k in known and k not in NOT_RESUMED + STARTING_POINT}

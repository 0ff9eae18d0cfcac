"""A search space over rayconv's run flags, read and checked without Ray.

A space is a JSON object (``--space '{...}'`` or a ``.json`` / ``.yaml`` file) of flag name -> one
distribution: ``{"grid": [v, ...]}`` (every value, crossed with the other grids), ``{"choice": [v,
...]}``, ``{"uniform": [low, high]}``, ``{"loguniform": [low, high]}`` (low > 0) or ``{"randint":
[low, high]}`` (integers, high excluded), as Ray Tune's ``grid_search``, ``choice``, ``uniform``,
``loguniform`` and ``randint`` take them. Names are Config's fields (``global_batch_size`` or
``global-batch-size``); each value has its field's type; and before any trial starts every sample that
can be listed (the grids' and choices' values crossed, each range at both ends) is checked with the
base settings as a run's settings are (``Config.validate``). Every error is a ConfigError of one line.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from rayconv.config import Config
from rayconv.errors import ConfigError, first_line
from rayconv.flags import flag, from_mapping

KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
# Flags a trial's folder and the search set (the search folder, a trial's resume, the cluster).
NOT_SEARCHED = ("out", "resume", "address", "evaluate_only", "layout")
MAX_CHECKED = 512  # samples checked one by one before trials start; above, each value alone
# What PBT may change when a trial continues another's checkpoint: settings read afresh at each step
# (the learning rate is passed per step; the loss and the augmentation are built from the settings),
# not ones the optimizer's saved state brings back (momentum, weight decay) or the model's shape.
PBT_MUTABLE = ("lr", "label_smoothing", "mixup_alpha", "cutmix_alpha", "random_erase")


def read_space(text: str) -> dict[str, Any]:
    """The space ``--space`` gives: a JSON object, or a ``.json`` / ``.yaml`` / ``.yml`` file holding one.
    Raises ConfigError."""
    path = Path(text)
    if not text.lstrip().startswith("{") and path.suffix in (".json", ".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"--space {text}: no such file")
        text = path.read_text()
        if path.suffix != ".json":
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"--space {path}: reading YAML needs PyYAML (pip install pyyaml); "
                                  "or give the space as JSON") from None
            try:
                space = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ConfigError(f"--space {path} is not valid YAML ({first_line(e)})") from None
            return _object(space, str(path))
    try:
        space = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--space is neither a JSON object nor a .json/.yaml file ({e}): e.g. "
                          "'{\"lr\": {\"loguniform\": [0.01, 1]}}'") from None
    return _object(space, "--space")


def _object(space: Any, what: str) -> dict[str, Any]:
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"{what} must be a non-empty object of flag -> distribution, e.g. "
                          "{\"lr\": {\"grid\": [0.05, 0.1]}}")
    return space


def check_space(space: dict[str, Any], base: dict[str, Any]) -> dict[str, tuple[str, list]]:
    """``space`` checked against Config's fields and, sample by sample, with the ``base`` settings (a
    mapping of run settings); returns {field: (kind, values)} with names as Config's. Raises ConfigError
    naming the flag and what to change."""
    known = {f.name: f for f in fields(Config)}
    checked: dict[str, tuple[str, list]] = {}
    for raw, dist in space.items():
        name = str(raw).lstrip("-").replace("-", "_")
        if name not in known:
            close = [k for k in known if name in k or k in name][:3]
            raise ConfigError(
                f"--space {raw}: no run flag of that name"
                f"{' (did you mean ' + ', '.join(flag(k) for k in close) + '?)' if close else ''}: "
                "python -m rayconv.run --help lists the flags"
            )
        if name in NOT_SEARCHED:
            raise ConfigError(
                f"--space {raw}: {flag(name)} is set by the search for each trial, not searched")
        if name in checked:
            raise ConfigError(f"--space names {flag(name)} twice")
        checked[name] = _distribution(name, dist, str(known[name].type))
    _check_samples(checked, base)
    return checked


def _distribution(name: str, dist: Any, ftype: str) -> tuple[str, list]:
    """(kind, values) of one dimension, its shape and types checked. Raises ConfigError."""
    if not isinstance(dist, dict) or len(dist) != 1 or next(iter(dist)) not in KINDS:
        raise ConfigError(f"--space {name}: give one of {', '.join(KINDS)}, e.g. "
                          f"{{\"{name}\": {{\"grid\": [...]}}}} (got {json.dumps(dist)})")
    kind, values = next(iter(dist.items()))
    if not isinstance(values, list) or not values:
        raise ConfigError(f"--space {name}: {kind} takes a non-empty list (got {json.dumps(values)})")
    if kind in ("grid", "choice"):
        for v in values:
            from_mapping({name: v})  # the field's type (raises ConfigError naming the flag)
        return kind, values
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"--space {name}: {kind} takes [low, high] numbers (got {json.dumps(values)})")
    low, high = values
    if kind == "randint":
        if "int" not in ftype or "float" in ftype:
            raise ConfigError(f"--space {name}: randint draws integers but {flag(name)} takes {ftype}: use "
                              "uniform or loguniform")
        if not (isinstance(low, int) and isinstance(high, int)) or high <= low:
            raise ConfigError(
                f"--space {name}: randint takes integers low < high, high excluded (got {values})")
        return kind, [low, high]
    if "float" not in ftype:
        raise ConfigError(f"--space {name}: {kind} draws real numbers but {flag(name)} takes "
                          f"{ftype.replace('Optional[', '').rstrip(']')}: use "
                          f"{'randint' if 'int' in ftype else 'grid or choice'}")
    if not low < high:
        raise ConfigError(f"--space {name}: {kind} takes low < high (got {values})")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(
            f"--space {name}: loguniform takes low > 0 (got {low}): use uniform for ranges from 0")
    return kind, [float(low), float(high)]


def _ends(kind: str, values: list) -> list:
    """The values of a dimension that stand for it in the checks: all listed, or a range's two ends."""
    if kind == "randint":
        return [values[0], values[1] - 1]
    return list(values)


def _check_samples(space: dict[str, tuple[str, list]], base: dict[str, Any]) -> None:
    """Every listed sample (``_ends`` crossed) with ``base`` validated as a run's settings; above
    ``MAX_CHECKED`` samples, each value with the others' first. Raises ConfigError naming the sample."""
    names = list(space)
    options = [_ends(*space[n]) for n in names]
    total = 1
    for o in options:
        total *= len(o)
    if total <= MAX_CHECKED:
        samples = [dict(zip(names, combo)) for combo in itertools.product(*options)]
    else:
        first = {n: o[0] for n, o in zip(names, options)}
        samples = [{**first, n: v} for n, o in zip(names, options) for v in o]
    for sample in samples:
        try:
            from_mapping({**base, **sample}).validate()
        except ConfigError as e:
            shown = ", ".join(f"{flag(k)} {v}" for k, v in sample.items())
            raise ConfigError(f"--space: the trial with {shown} would be refused: {e}") from None


def default_metric(base: dict[str, Any], space: dict[str, Any]) -> str:
    """The metric a search ranks trials by: ``val_accuracy`` when its runs hold out a validation split
    (``--val-split``, where rayconv has it, in the base settings or the space), else ``test_accuracy``."""
    if "val_split" in {f.name for f in fields(Config)} and (base.get("val_split") or "val_split" in space):
        return "val_accuracy"
    return "test_accuracy"


def check_metric(metric: str, mode: str, base: dict[str, Any], space: dict[str, Any]) -> None:
    """Refuse a ``--metric`` the trials do not report or a ``--mode`` other than max/min. Raises
    ConfigError."""
    split = "val" if metric.startswith("val_") else "test"
    names = {f"{split}_{k}" for k in ("accuracy", "loss", "error", "top5_accuracy")} | {"train_loss"}
    if metric not in names:
        raise ConfigError(
            f"--metric {metric}: choose test_accuracy, test_loss, test_error, test_top5_accuracy, "
            "train_loss (or val_* with --val-split)")
    if split == "val" and default_metric(base, space) != "val_accuracy":
        raise ConfigError(
            f"--metric {metric} is a validation split's: give --val-split F, or rank by test_accuracy")
    if mode not in ("max", "min"):
        raise ConfigError(f"--mode {mode}: choose max or min")


def pbt_base(base: dict[str, Any], space: dict[str, tuple[str, list]]) -> dict[str, Any]:
    """``base`` for a PBT search of the checked ``space``: ``checkpoint_every`` set to ``eval_every``, so
    that every evaluation Tune sees has its checkpoint, which another trial may continue. Raises
    ConfigError: no ``PBT_MUTABLE`` dimension in the space, no ``--eval-every``, another
    ``--checkpoint-every``."""
    if not any(name in PBT_MUTABLE for name in space):
        raise ConfigError(
            f"--scheduler pbt perturbs {', '.join(flag(n) for n in PBT_MUTABLE)} when a trial continues "
            "another's checkpoint: search at least one of them in --space"
        )
    every = base.get("eval_every")
    if not every:
        raise ConfigError(
            "--scheduler pbt continues trials from the checkpoint of an evaluation: give --eval-every N "
            "(the trials then checkpoint every N steps)")
    if base.get("checkpoint_every") not in (None, 0, every):
        raise ConfigError(f"--scheduler pbt checkpoints at each evaluation: drop --checkpoint-every "
                          f"{base['checkpoint_every']} (or give it as --eval-every {every})")
    return {**base, "checkpoint_every": every}

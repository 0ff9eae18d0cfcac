"""``--model``'s names known without importing torchvision: rayconv's own, and torchvision's
classification models as last listed on this machine for the installed torchvision version.

Listing torchvision's models imports torchvision, and torch._dynamo with it (seconds); a run whose
actors check the model (``driver.resolve.WarmCheck``) never lists them in the driver, so a mistyped
name would be refused only after Ray and the actors started. ``models.model_names`` remembers each
listing in ``$RAYCONV_CACHE_DIR`` (default ``~/.cache/rayconv/``), one file per torchvision version,
and ``check_known`` refuses a name missing from it before Ray starts. Without a listing yet (or with
another torchvision version) nothing is refused here: the model's own check does it, as before.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Optional

from rayconv.errors import ConfigError
from rayconv.files import cache_dir, write_json
from rayconv.user_model import SPEC_FORM, is_user_model

RAYCONV_MODELS = ("convnet", "convnet_bn", "convnet2col", "alexnet2012")
LIST_MODELS = (
    "`python -c 'import torchvision; print(torchvision.models.list_models(module=torchvision.models))'`"
)
_WRITTEN: dict[Path, list[str]] = {}   # the listing this process found (or wrote) in each file


def is_torchvision_model(name: object) -> bool:
    """Whether ``--model name`` names one of torchvision's models: a name, neither rayconv's own nor a
    user's (``MODULE:FUNCTION``, ``file.py:FUNCTION``, a callable)."""
    return isinstance(name, str) and name not in RAYCONV_MODELS and not is_user_model(name)


def _listing() -> Optional[Path]:
    """The file of torchvision's model names for the installed version; None without torchvision."""
    try:
        version = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        return None
    return cache_dir() / f"torchvision-{version}-models.json"


def remember(torchvision_names: list[str]) -> None:
    """Write torchvision's classification model names for ``check_known`` (``files.write_json``: a whole
    file or none), once per process and only where the file holds another listing; a folder that cannot
    be written is left as it is."""
    path, names = _listing(), sorted(torchvision_names)
    if path is None or _WRITTEN.get(path) == names:
        return
    if remembered() != names:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, names)
        except OSError:
            return
    _WRITTEN[path] = names


def remembered() -> Optional[list[str]]:
    """torchvision's model names as ``remember`` wrote them for this version, or None."""
    path = _listing()
    try:
        names = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    return names if isinstance(names, list) else None


def unknown_model(name: str, names: list[str]) -> ConfigError:
    """The one-line refusal of ``--model name``, ``names`` being every accepted name (rayconv's first)."""
    close = [n for n in names if n.startswith(name[:3])][:8]
    hint = f" (close: {', '.join(close)})" if close else ""
    if name.endswith(".py"):  # (a model file given without its function)
        hint = f" (your own model file? --model {name}:FUNCTION, FUNCTION returning the nn.Module)"
    elif "." in name:  # (module.function: the user's own model, given without its colon)
        hint = f" (your own model? --model {name.rpartition('.')[0]}:{name.rpartition('.')[2]})"
    return ConfigError(
        f"unknown --model {name!r}{hint}: use {', '.join(RAYCONV_MODELS)}, or any of torchvision's "
        f"{len(names) - len(RAYCONV_MODELS)} classification models (alexnet, resnet18, vgg16, ...; "
        f"{LIST_MODELS} lists them), or your own as {SPEC_FORM}")


def check_known(name: object) -> None:
    """Refuse ``--model name`` where it is neither rayconv's nor a user's model and a listing of this
    torchvision's models (``remember``) lacks it. Raises ConfigError (``unknown_model``'s line)."""
    if not is_torchvision_model(name):
        return
    listed = remembered()
    if listed is not None and name not in listed:
        raise unknown_model(name, list(RAYCONV_MODELS) + listed)

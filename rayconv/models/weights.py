"""``--init PATH``: start a model from given weights (a run's ``model.pt``, a torchvision-format
``state_dict``, or a run folder holding ``model.pt``).

The file is read with ``torch.load(weights_only=True)``: a plain ``state_dict``, or a dict holding one
under ``model`` or ``state_dict`` (torchvision's reference checkpoints); a ``module.`` prefix on every
key (a DDP-wrapped model's) is dropped. Keys and shapes are checked against the model before anything
is copied, the first mismatch named. ``--init-skip-head`` leaves the classifier (the model's last
``nn.Linear``, its weight and bias) as built, for a new number of classes. Like ``--data-dir``, PATH
must be readable on every node of the cluster (each actor builds its part from it): a local path, or a
URI (``s3://bucket/runs/r1/model.pt``, ``storage.locate``) read with each node's own credentials.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from rayconv.errors import ConfigError

INIT_TAKES = ("--init takes a run's model.pt or run folder, a torchvision weights file, or a file written by "
              "torch.save(model.state_dict(), PATH) (not a whole pickled model, not an image)")


def init_file(path: str) -> Any:
    """The weights file of ``--init path`` (``model.pt`` inside a run folder): a Path, or a
    ``storage.Location`` for a URI. Raises ConfigError (StorageError: a store that cannot be read)."""
    from rayconv.storage import is_uri, place, storage_errors
    from rayconv.storage_checks import check_readable
    p = place(path, flag="--init") if is_uri(path) else Path(path)
    if not isinstance(p, Path):
        check_readable(p, "--init")
    with storage_errors(p, "--init") if not isinstance(p, Path) else contextlib.nullcontext():
        if p.is_dir():
            p = p / "model.pt"
        if not p.is_file():
            raise ConfigError(f"--init {path}: no such file (give a model.pt, a run folder or a state_dict "
                              "file)")
    return p


def read_state(path: str) -> dict[str, torch.Tensor]:
    """The state_dict of ``--init path`` on the CPU (see the module docstring). Raises ConfigError."""
    p = init_file(path)
    try:
        obj = torch.load(p if isinstance(p, Path) else io.BytesIO(p.read_bytes()), map_location="cpu",
                         weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to replace
        # (torch's own message advises weights_only=False, which would run the file's code: not ours to give)
        raise ConfigError(
            f"--init {path}: cannot be read as a state_dict or checkpoint ({type(e).__name__} from "
            f"torch.load(weights_only=True)): {INIT_TAKES}") from None
    if isinstance(obj, dict):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"--init {path}: holds no state_dict (a dict of tensors): {INIT_TAKES}")
    if all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def head_keys(model: nn.Module) -> tuple[str, ...]:
    """The state_dict keys of the model's last ``nn.Linear`` (its classifier). Raises ConfigError."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError(
            "--init-skip-head leaves the classifier (the last nn.Linear) as built, but the model "
            "has no nn.Linear: drop --init-skip-head")
    prefix = f"{linears[-1]}." if linears[-1] else ""
    return tuple(k for k in model.state_dict() if k.startswith(prefix) and "." not in k[len(prefix):])


def load_init(model: nn.Module, path: str, skip_head: bool = False) -> None:
    """Copy ``--init path``'s weights into ``model`` in place (converted to the model's dtype), after
    checking every key and shape; with ``skip_head`` the classifier stays as built. Raises ConfigError
    naming the first missing, unexpected or mis-shaped key."""
    state = read_state(path)
    skipped = head_keys(model) if skip_head else ()
    own = model.state_dict()
    head = skipped or (head_keys(model) if any(isinstance(m, nn.Linear) for m in model.modules()) else ())
    problem = _first_mismatch(own, state, skipped, head)
    if problem is not None:
        raise ConfigError(f"--init {path}: {problem}")
    model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=not skipped)


def _first_mismatch(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                    skipped: tuple[str, ...], head: tuple[str, ...]) -> Optional[str]:
    for k, t in own.items():
        if k in skipped:
            continue
        if k not in state:
            return f"has no {k!r}, which the model has (another model's weights?)"
        if tuple(state[k].shape) != tuple(t.shape):
            hint = "; for a new number of classes add --init-skip-head" if k in head else ""
            return (f"{k!r} has shape {tuple(state[k].shape)}, the model's {tuple(t.shape)}{hint}")
    extra = [k for k in state if k not in own and k not in skipped]
    if extra:
        return f"holds {extra[0]!r}, which the model has not (another model's weights?)"
    return None

"""A checkpoint's rank files joined into the whole model's state, and any actor's part cut from it: what
lets ``--resume`` continue a checkpoint under another layout (dp, pp cut and schedule, fs, ``--plan``).

Each rank file (``actor/state.py``'s ``rank_file``) keys its parameters and buffers by the whole
model's ``state_dict`` names, and says which of them the filter split sliced (``split_dims``), the
names of its optimizer's parameters (``optimizer_names``, group by group) and of its part's layers
(``part_names``, for the moving average's keys). ``join`` turns the rank files into one "whole" state,
everything keyed by parameter name:

* ``model``: every parameter and buffer, whole (filter-split slices concatenated in split order,
  pipeline stages' disjoint keys merged, replicas' equal copies taken from the first);
* ``optimizer``: ``state`` (parameter name -> its state, e.g. ``momentum_buffer``, joined like the
  parameter) and ``groups`` (group name -> its settings, ``params`` left out);
* ``ema``: the moving average (``tensors`` by name, joined like the model; ``decay``, ``every``,
  ``n_averaged``) or None; ``loss_scale`` (fp16) and ``rng``: the first rank file's (every actor holds
  the same scale, and every random stream is reseeded each step from (seed, step, coordinate):
  ``actor/step.py``'s ``seed``).

``cut`` is the inverse for one actor: the slice ``filter_split.split`` gives actor ``index`` of ``n``
(``mesh.split_sizes`` along the split dimension, as ``_slice_module`` slices). The whole state is a
plain ``torch.save`` of tensors and plain types (``checkpoint.whole_state`` reads a checkpoint folder
without Ray; ``torch.load(..., weights_only=True)`` reads the bytes ``whole_blob`` makes).
"""

from __future__ import annotations

import io
from typing import Any, Optional

import torch
from torch import nn

from rayconv.errors import CheckpointError
from rayconv.mesh import split_sizes

PER_LAYER = "krizhevsky2014"


def split_position(coord: tuple[int, int, int], dp: int, fs: int, plan: str) -> tuple[int, int]:
    """(index, count) of the split an actor at ``coord`` (dp, pp, fs) holds a slice of: the fs axis, or
    the dp axis under Krizhevsky 2014's per-layer plan (its fully connected layers split over dp)."""
    return (coord[0], dp) if plan == PER_LAYER else (coord[2], fs)


def join_tensors(pieces: list[tuple[int, dict[str, int], dict[str, torch.Tensor]]], n: int
                 ) -> dict[str, torch.Tensor]:
    """One dict of whole tensors from the parts ``pieces`` (split index, split_dims, tensors by name), in
    rank order, split ``n`` ways: a split key's slices concatenated in split-index order (one per index:
    replicas hold equal copies), any other key taken from its first holder. Raises CheckpointError for
    a split key whose slices do not cover the split."""
    out: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(k for _, _, t in pieces for k in t):
        holders = [(i, dims, t[key]) for i, dims, t in pieces if key in t]
        dims = holders[0][1]
        if key not in dims or not isinstance(holders[0][2], torch.Tensor) or holders[0][2].dim() == 0:
            out[key] = holders[0][2]
            continue
        by_index: dict[int, torch.Tensor] = {}
        for i, _, v in holders:
            by_index.setdefault(i, v)
        if sorted(by_index) != list(range(n)):
            raise CheckpointError(f"the checkpoint's slices of {key} cover split indices {sorted(by_index)} "
                                  "only: use another checkpoint")
        out[key] = torch.cat([by_index[i] for i in range(n)], dim=dims[key])
    return out


def cut(whole: torch.Tensor, dim: int, index: int, n: int) -> torch.Tensor:
    """Actor ``index``'s slice of ``whole`` split ``n`` ways along ``dim`` (a copy)."""
    sizes = split_sizes(whole.shape[dim], n)
    return whole.narrow(dim, sum(sizes[:index]), sizes[index]).clone()


def cut_tensors(whole: dict[str, torch.Tensor], keys: dict[str, torch.Size], split_dims: dict[str, int],
                index: int, n: int) -> dict[str, torch.Tensor]:
    """The tensors of ``keys`` (name -> the part's shape) cut from ``whole``: split keys sliced, others
    whole. Raises RuntimeError naming a key that is missing or does not fit its shape."""
    out = {}
    for k, shape in keys.items():
        if k not in whole:
            raise RuntimeError(f"the checkpoint holds no {k}, which this part has")
        v = whole[k]
        if k in split_dims and v.dim() > 0:
            v = cut(v, split_dims[k], index, n)
        if v.shape != shape:
            raise RuntimeError(f"the checkpoint's {k} has shape {tuple(v.shape)}, this part's is "
                               f"{tuple(shape)}")
        out[k] = v
    return out


def _ema_by_name(ema: dict[str, Any], part_names: list[Optional[str]]) -> dict[str, torch.Tensor]:
    """A part's moving-average tensors (keyed ``<position in the part>.<key>``) by the model's names."""
    out = {}
    for k, v in ema["tensors"].items():
        pos, rest = k.split(".", 1)
        name = part_names[int(pos)]
        out[f"{name}.{rest}" if name else rest] = v
    return out


def join(payloads: list[dict[str, Any]], layout: dict[str, Any]) -> dict[str, Any]:
    """The whole state (module docstring) from every rank file's payload, in rank order, of a checkpoint
    saved under ``layout`` (its manifest's). Raises CheckpointError for rank files without the names
    (written before checkpoints carried them: resume with their layout)."""
    if any("optimizer_names" not in p for p in payloads):
        raise CheckpointError("the checkpoint's rank files carry no parameter names, so they load only under "
                              f"the layout they were saved with: resume with --dp {layout['dp']} --pp "
                              f"{layout['pp']} --fs {layout['fs']} --plan {layout['plan']}")
    at = [split_position(p["coord"], layout["dp"], layout["fs"], layout["plan"]) for p in payloads]
    n = at[0][1]
    dims = [dict(p["split_dims"]) for p in payloads]
    model = join_tensors([(i, d, p["model"]) for (i, _), d, p in zip(at, dims, payloads)], n)
    opt_state: list[tuple[int, dict[str, int], dict[str, torch.Tensor]]] = []
    groups: dict[str, dict[str, Any]] = {}
    for (i, _), d, p in zip(at, dims, payloads):
        sd, flat = p["optimizer"], {}
        for group, names in zip(sd["param_groups"], p["optimizer_names"]):
            groups.setdefault(group.get("name", ""), {k: v for k, v in group.items() if k != "params"})
            for idx, name in zip(group["params"], names):
                for k, v in sd["state"].get(idx, {}).items():
                    flat[f"{name}\0{k}"] = v
        opt_state.append((i, {key: d[key.split("\0")[0]] for key in flat if key.split("\0")[0] in d}, flat))
    state: dict[str, dict[str, Any]] = {}
    for key, v in join_tensors(opt_state, n).items():
        name, k = key.split("\0")
        state.setdefault(name, {})[k] = v
    ema = None
    if payloads[0].get("ema") is not None:
        e = payloads[0]["ema"]
        tensors = join_tensors([(i, d, _ema_by_name(p["ema"], p["part_names"]))
                                for (i, _), d, p in zip(at, dims, payloads)], n)
        ema = {"decay": e["decay"], "every": e["every"], "n_averaged": e["n_averaged"], "tensors": tensors}
    return {"whole": True, "model": model, "optimizer": {"state": state, "groups": groups}, "ema": ema,
            "loss_scale": payloads[0].get("loss_scale"), "rng": payloads[0]["rng"]}


def optimizer_param_names(names: list[Optional[str]], part: nn.Sequential,
                          optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The whole model's name of each of ``optimizer``'s parameters, group by group (its state_dict's
    ``params`` order); ``names[i]``: the model layer name of ``part[i]`` (None for an exchange)."""
    name_of = {}
    for name, sub in zip(names, part):
        if name is not None:
            for k, p in sub.named_parameters():
                name_of[id(p)] = f"{name}.{k}" if name else k
    return [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def cut_part(whole: dict[str, Any], names: list[Optional[str]], part: nn.Sequential,
             optimizer: torch.optim.Optimizer, split_dims: dict[str, int], index: int,
             n: int) -> dict[str, Any]:
    """One part's rank-file payload cut from the whole state: its parameters and buffers, its
    parameters' optimizer state (sliced as the parameter is; ``optimizer``'s own group layout with the
    saved groups' settings), its moving average (keyed as ``PartEMA`` keys it), the loss scale and
    RNG states as they are. ``index``, ``n``: ``split_position``'s. Raises RuntimeError for a tensor
    that is missing or does not fit."""
    keys = {(f"{name}.{k}" if name else k): (f"{pos}.{k}", v.shape)
            for pos, (name, sub) in enumerate(zip(names, part)) if name is not None
            for k, v in sub.state_dict().items()}
    shapes = {k: shape for k, (_, shape) in keys.items()}
    out = {**whole, "model": cut_tensors(whole["model"], shapes, split_dims, index, n)}
    sd = optimizer.state_dict()
    saved_state, saved_groups = whole["optimizer"]["state"], whole["optimizer"]["groups"]
    opt_state = {}
    for group, group_names in zip(sd["param_groups"], optimizer_param_names(names, part, optimizer)):
        group.update(saved_groups.get(group.get("name", ""), {}))
        for idx, name in zip(group["params"], group_names):
            if name in saved_state:
                opt_state[idx] = {k: (cut_tensors({name: v}, {name: shapes[name]}, split_dims, index, n)[name]
                                      if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                  for k, v in saved_state[name].items()}
    out["optimizer"] = {"state": opt_state, "param_groups": sd["param_groups"]}
    if whole.get("ema") is not None:
        by_name = cut_tensors(whole["ema"]["tensors"], shapes, split_dims, index, n)
        out["ema"] = {**whole["ema"], "tensors": {keys[k][0]: v for k, v in by_name.items()}}
    return out


def whole_blob(payloads: list[dict[str, Any]], layout: dict[str, Any]) -> bytes:
    """``join`` of a checkpoint's rank payloads (``Checkpoint.payloads``) as ``torch.save`` bytes."""
    buf = io.BytesIO()
    torch.save(join(payloads, layout), buf)
    return buf.getvalue()

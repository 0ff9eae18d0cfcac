"""A checkpoint's rank files in the form the actors write them (manifest ``format`` 2): one copy of
each tensor over the data-parallel replicas.

An actor's state (``actor/state.py``'s ``rank_payload``: model, optimizer, moving average, loss scale,
RNG, names) is cut here into a *skeleton* (everything but the large tensors, small) and its *entries*:
each parameter and buffer (``model/<name>``), each optimizer state tensor (``optimizer/<index>/<key>``)
and each moving-average tensor (``ema/<key>``). The dp replicas of one (pp, fs) position hold equal
copies of their entries, so they split the writing (``deal``): every replica's ``rank-<r>.pt`` holds its
own skeleton and the entries dealt to it, largest first to the replica with the fewest bytes so far, and
the bytes a replica writes fall as 1/dp. Two kinds are not dealt:

* ``buffer``: batch-norm running statistics and other buffers, which may differ between replicas (as
  in DDP each replica keeps its own, then follows replica 0's after each step): replica 0's copy is
  written, the copy a checkpoint and ``model.pt`` have always kept (``reshard.join``, ``export``);
* ``own``: under Krizhevsky 2014's per-layer plan the dp axis also splits the fully connected layers,
  so each replica holds a slice of its own of those keys: each writes its own.

A file is ``{"format": 2, "skeleton": ..., "tensors": {entry: tensor}, "own": [entry, ...]}``;
``rank_payloads`` rebuilds every rank's payload (the form ``reshard.join`` and ``load_rank_file``
read) from the files of its position. All of it loads with ``weights_only=True``.
"""

from __future__ import annotations

import io
from typing import Any, Iterator, Optional

import torch

from rayconv.errors import CheckpointError

RANK_FILE_FORMAT = 2
BUFFER, OWN, SHARED = "buffer", "own", "shared"
HELD = "\0entry"   # what a skeleton holds in an entry's place


def entries_of(payload: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(entry name, the model's parameter or buffer name it belongs to, value) of every tensor entry."""
    for name, v in payload["model"].items():
        yield f"model/{name}", name, v
    by_index = {i: n for g, names in zip(payload["optimizer"]["param_groups"], payload["optimizer_names"])
                for i, n in zip(g["params"], names)}
    for i, st in payload["optimizer"]["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) or v == HELD:
                yield f"optimizer/{i}/{k}", by_index[i], v
    if payload.get("ema") is not None:
        names = payload["part_names"]
        for k, v in payload["ema"]["tensors"].items():
            pos, rest = k.split(".", 1)
            yield f"ema/{k}", f"{names[int(pos)]}.{rest}" if names[int(pos)] else rest, v


def _slot(payload: dict[str, Any], entry: str) -> tuple[dict, Any]:
    """The dict holding ``entry`` in ``payload`` and its key there."""
    kind, rest = entry.split("/", 1)
    if kind == "model":
        return payload["model"], rest
    if kind == "ema":
        return payload["ema"]["tensors"], rest
    i, k = rest.rsplit("/", 1)
    return payload["optimizer"]["state"][int(i)], k


def split_payload(payload: dict[str, Any], buffers: set[str], per_layer_split: bool
                  ) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, str]]]:
    """(skeleton, entries): ``payload`` with every tensor entry replaced by ``HELD``, and the entries by name,
    each (tensor, kind: ``buffer``, ``own`` or ``shared``). ``buffers``: the model's buffer names;
    ``per_layer_split``: the dp axis splits ``payload["split_dims"]``'s keys (per-layer plan)."""
    skeleton = {**payload, "model": dict(payload["model"]),
                "optimizer": {**payload["optimizer"],
                              "state": {i: dict(s) for i, s in payload["optimizer"]["state"].items()}}}
    if payload.get("ema") is not None:
        skeleton["ema"] = {**payload["ema"], "tensors": dict(payload["ema"]["tensors"])}
    split = payload["split_dims"]
    entries = {}
    for entry, name, v in list(entries_of(payload)):
        kind = BUFFER if name in buffers else OWN if per_layer_split and name in split else SHARED
        entries[entry] = (v, kind)
        holder, key = _slot(skeleton, entry)
        holder[key] = HELD
    return skeleton, entries


def deal(sizes: dict[str, tuple[int, str]], dp: int) -> dict[str, int]:
    """The replica (0 .. dp - 1) that writes each entry of ``sizes`` (entry -> (bytes, kind)); ``own``
    entries are left out (each replica writes its own). Buffers go to replica 0, the shared entries
    largest first to the replica with the fewest bytes so far (ties: the lower index). The same on
    every replica of a position, which holds the same entries of the same sizes."""
    load = [0] * dp
    out = {}
    for entry, (n, kind) in sizes.items():
        if kind == BUFFER:
            out[entry] = 0
            load[0] += n
    for entry, (n, kind) in sorted(sizes.items(), key=lambda kv: (-kv[1][0], kv[0])):
        if kind == SHARED:
            r = min(range(dp), key=lambda i: (load[i], i))
            out[entry] = r
            load[r] += n
    return out


def rank_file_of(skeleton: dict[str, Any], entries: dict[str, tuple[torch.Tensor, str]], replica: int,
            dp: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What replica ``replica`` of ``dp`` writes: (the file's object with its tensors left out, the
    tensors it holds by entry). The tensors are those given (copy them first if they may change)."""
    writer = deal({e: (t.numel() * t.element_size(), kind) for e, (t, kind) in entries.items()}, dp)
    mine = {e: t for e, (t, kind) in entries.items() if kind == OWN or writer.get(e) == replica}
    own = [e for e, (_, kind) in entries.items() if kind == OWN]
    return {"format": RANK_FILE_FORMAT, "skeleton": skeleton, "own": own}, mine


def payloads_of(files: dict[str, bytes], layout: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's payload (``rank_payload``'s form), in rank order, from a checkpoint's verified files
    (``Checkpoint.files``) of either form: whole states (format 1) as they are, dealt rank files (format
    2) through ``rank_payloads``."""
    loaded = [torch.load(io.BytesIO(files[f"rank-{r}.pt"]), map_location="cpu", weights_only=True)
              for r in range(int(layout["world_size"]))]
    return rank_payloads(loaded, layout) if loaded and loaded[0].get("format") == RANK_FILE_FORMAT else loaded


def rank_payloads(files: list[dict[str, Any]], layout: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's payload (``rank_payload``'s form), in rank order, from a format-2 checkpoint's
    ``rank-<r>.pt`` files (loaded): each rank's skeleton filled from the files of its (pp, fs) position
    (the replicas' equal copies are one tensor object, not copies). Raises CheckpointError for an entry
    that no file of its position holds."""
    by_position: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for f in files:
        c = f["skeleton"]["coord"]
        own = set(f["own"])
        shared = {e: t for e, t in f["tensors"].items() if e not in own}
        by_position.setdefault((c[1], c[2]), {}).update(shared)
    out = []
    for r, f in enumerate(files):
        payload, c = f["skeleton"], f["skeleton"]["coord"]
        shared, own = by_position[(c[1], c[2])], set(f["own"])
        for entry, _, _ in list(entries_of(payload)):
            t: Optional[torch.Tensor] = f["tensors"].get(entry) if entry in own else shared.get(entry)
            if t is None:
                role = layout["roles"][r] if "roles" in layout else r
                raise CheckpointError(f"the checkpoint's rank files hold no {entry} for rank {r} ({role}): "
                                      "use another checkpoint")
            holder, key = _slot(payload, entry)
            holder[key] = t
        out.append(payload)
    return out


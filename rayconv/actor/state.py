"""State in and out of an actor: its parameters and buffers (``model_state``, ``load_model_state``), the
dimensions filter split cuts (``split_dims``), its rank file (``rank_file``, ``checkpoint_rank_file``:
the rank file of a checkpoint it writes, ``load_rank_file``: model, optimizer, loss-scale,
moving-average and RNG states); ``weights`` swaps the moving average in (``model_state``, and
``evaluate`` in ``worker.py``). Each reads the actor's ``build.ActorState``.
"""

from __future__ import annotations

import io
import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from rayconv.actor.build import ActorState
from rayconv.outputs.rank_files import rank_file_of, split_payload
from rayconv.outputs.reshard import PER_LAYER, cut_part, optimizer_param_names, split_position


def model_state(a: ActorState, ema: bool = False) -> dict[str, torch.Tensor]:
    """This actor's parameters and buffers on CPU, keyed by the whole model's state_dict names;
    ``ema``: those of its moving average (--model-ema; RuntimeError without it)."""
    with weights(a, ema):
        return _model_state(a)


def _model_state(a: ActorState) -> dict[str, torch.Tensor]:
    out = {}
    for name, sub in zip(a.parallel.names, a.part):
        if name is None:
            continue  # an exchange, no state
        for k, v in sub.state_dict().items():
            out[f"{name}.{k}" if name else k] = v.detach().to("cpu", copy=True)
    return out


@contextmanager
def weights(a: ActorState, ema: bool) -> Iterator[None]:
    """The part holds the moving average's tensors inside the block when ``ema`` (copied in place,
    so compiled and captured code keeps its tensors), its own outside. Raises RuntimeError for
    ``ema`` without --model-ema."""
    if not ema:
        yield
        return
    if a.recipe.ema is None:
        raise RuntimeError("no moving average of the weights: the run was started without --model-ema")
    own = {k: v.detach().clone() for k, v in a.part.state_dict().items()}
    a.recipe.ema.copy_to(a.part)
    try:
        yield
    finally:
        a.part.load_state_dict(own)


def split_dims(a: ActorState) -> dict[str, int]:
    """state_dict keys that filter split cuts, and the dimension (empty without filter split)."""
    return dict(a.parallel.sliced.split_dims)


def rank_file(a: ActorState) -> bytes:
    """This actor's rank file as ``torch.save`` bytes (``rank_payload``: the whole of it, copied)."""
    buf = io.BytesIO()
    torch.save(rank_payload(a, copy=True), buf)
    return buf.getvalue()


def rank_payload(a: ActorState, copy: bool) -> dict[str, Any]:
    """This actor's rank file: model state (keys as in ``model_state()``), optimizer state_dict, the fp16 loss
    scale's state (``loss_scale``, None without fp16), the moving average's (``ema``, None without
    --model-ema) and RNG states, all tensors and plain types (loads with ``weights_only=True``).
    ``copy`` False: the model's, optimizer's and moving average's tensors are the live ones (on the
    device; ``checkpoint_rank_file`` copies those it writes)."""
    np_state = np.random.get_state()
    rng = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
           "numpy_pos": int(np_state[2]), "numpy_has_gauss": int(np_state[3]),
           "numpy_cached_gaussian": float(np_state[4]), "python": _plain(random.getstate())}
    if a.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(a.device)
    keep = _to_cpu if copy else (lambda x: x)
    model = _model_state(a) if copy else {f"{n}.{k}" if n else k: v.detach()
                                    for n, sub in zip(a.parallel.names, a.part)
                                    if n is not None for k, v in sub.state_dict().items()}
    return {"rank": a.rank, "role": a.role, "coord": list(a.coord), "model": model,
            "optimizer": keep(a.optimizer.state_dict()), "rng": rng,
            "loss_scale": None if a.recipe.scaler is None else _to_cpu(a.recipe.scaler.state_dict()),
            "ema": None if a.recipe.ema is None else keep(a.recipe.ema.state_dict()),
            # what outputs/reshard.py joins the rank files by, under another layout
            "split_dims": split_dims(a), "optimizer_names": optimizer_names(a),
            "part_names": list(a.parallel.names)}


def checkpoint_rank_file(a: ActorState) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
    """What this actor writes of a checkpoint (``outputs.rank_files``): (its file's object without the
    tensors, the tensors dealt to it copied to host memory, pinned on a GPU, and a CUDA event the
    copies are done at, or None). Only the copies are taken here; serialising them is the caller's
    (in the background)."""
    names = {f"{n}.{k}" if n else k for n, sub in zip(a.parallel.names, a.part) if n is not None
             for k, _ in sub.named_buffers()}
    skeleton, entries = split_payload(rank_payload(a, copy=False), names,
                                      a.routing.per_layer_plan == PER_LAYER and a.mesh.dp > 1)
    header, mine = rank_file_of(skeleton, entries, a.coord.dp, a.mesh.dp)
    done = None
    if a.device.type == "cuda":
        host = {e: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for e, t in mine.items()}
        done = torch.cuda.Event()
        done.record()
    else:
        host = {e: t.detach().clone() for e, t in mine.items()}
    return header, host, done


def optimizer_names(a: ActorState) -> list[list[str]]:
    """The whole model's name of each parameter of the optimizer, group by group."""
    return optimizer_param_names(a.parallel.names, a.part, a.optimizer)


def load_rank_file(a: ActorState, blob: bytes, next_step: int) -> None:
    """Load a rank file written by ``rank_file`` (this rank's, under the layout it was saved with), or
    a checkpoint's whole state (``outputs.reshard.join``, under another layout: this part cut from it);
    the next ``train_step`` is ``next_step``. Raises RuntimeError if it does not fit this part (or
    lacks the loss scale or moving average this run keeps)."""
    payload = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if payload.get("whole"):
        payload = _cut_whole(a, payload)
    load_model_state(a, payload["model"])
    a.optimizer.load_state_dict(payload["optimizer"])
    _load_recipe(a, payload)
    rng = payload["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(("MT19937", rng["numpy_keys"].numpy().astype(np.uint32), rng["numpy_pos"],
                         rng["numpy_has_gauss"], rng["numpy_cached_gaussian"]))
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in rng and a.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], a.device)
    a.batches.first_step = next_step
    if a.step_graph is not None:
        a.step_graph.reset()  # the optimizer's momentum buffers are new tensors: capture again


def _cut_whole(a: ActorState, whole: dict[str, Any]) -> dict[str, Any]:
    """This part's shard cut from a checkpoint's whole state (``reshard.cut_part``)."""
    index, n = split_position(a.coord, a.mesh.dp, a.mesh.fs, a.routing.per_layer_plan)
    return cut_part(whole, a.parallel.names, a.part, a.optimizer, split_dims(a), index, n)


def _load_recipe(a: ActorState, payload: dict[str, Any]) -> None:
    """The loss scale and the moving average from a rank file (those this run keeps)."""
    for name, held in (("loss_scale", a.recipe.scaler), ("ema", a.recipe.ema)):
        if held is None:
            continue
        if payload.get(name) is None:
            raise RuntimeError(f"the rank file holds no {name} state, which this run keeps "
                               "(--precision fp16 / --model-ema must match the checkpointed run)")
        held.load_state_dict(payload[name])


def load_model_state(a: ActorState, state: dict[str, torch.Tensor]) -> None:
    """Inverse of ``model_state()``: copy parameters and buffers into this part (strict: every key of the
    part present, none left over). Raises RuntimeError naming the keys that do not match."""
    used = set()
    for name, sub in zip(a.parallel.names, a.part):
        if name is None:
            continue
        mine = {}
        for k in sub.state_dict():
            full = f"{name}.{k}" if name else k
            if full in state:
                mine[k] = state[full]
                used.add(full)
        sub.load_state_dict(mine, strict=True)
    extra = sorted(set(state) - used)
    if extra:
        raise RuntimeError(f"rank file holds keys this part does not have: {extra[:5]}")


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (dicts and lists rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _plain(obj: Any) -> Any:
    """Tuples as lists, recursively (plain types that ``weights_only`` loading accepts)."""
    return [_plain(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


"""The flat layer view of any model torch.fx can trace: its forward cut where exactly one tensor is live.

``traced_layers`` traces ``model.forward`` (``torch.fx.symbolic_trace``, which inlines the user's own
modules down to torch's built-in layers), walks the graph in order and marks every point where exactly
one value is live (computed and still needed later): in a ResNet, the boundaries between blocks, never
the inside of a block, where the skip keeps the block's input alive. The pieces between consecutive
such points are the layers the pipeline balancer cuts (``parallel/pipeline/stages.py``), so a stage
boundary never has to carry more than one tensor. Each piece is built from the user's own modules:

* a piece that is exactly one call of a submodule taking one input (a residual block, a convolution)
  is that submodule, named by its path in the model;
* ``torch.flatten(x, d)`` alone is ``nn.Flatten(d)``, ``torch.relu(x)`` alone ``nn.ReLU()``;
* any other piece is a ``torch.fx.GraphModule`` rooted at the deepest submodule holding all the
  modules it calls, named by that submodule's path.

So ``f"{name}.{key}"`` over every piece's ``state_dict`` gives exactly ``model.state_dict()``'s keys,
and the parts' assembled state loads into the user's class (``outputs/export.py``). Pieces that use
the same parameter (tied weights) are merged with every piece between them. A model fx cannot trace
(data-dependent control flow), whose traced forward reads ``self.training``, or which has no
single-tensor point inside raises ``NotCuttable`` with the reason in one line.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx, nn


class NotCuttable(Exception):
    """Why a model's forward cannot be cut into pipeline pieces (one line)."""


@dataclass
class _Piece:
    """Consecutive compute nodes of the traced graph; ``src`` the one value live before them, ``dst``
    the one live after them."""

    nodes: list[fx.Node] = field(default_factory=list)
    src: Optional[fx.Node] = None
    dst: Optional[fx.Node] = None


def traced_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) pieces whose composition computes ``model(x)`` for one tensor ``x``; the modules
    are (or hold) the model's own submodules, so they share its parameters. Raises NotCuttable."""
    graph = _trace(model)
    calls = _module_calls(graph)
    pieces = _coarsen(model, _merge_tied(model, _split(graph)), calls)
    if len(pieces) < 2:
        raise NotCuttable("its traced graph has no point inside where exactly one tensor is live")
    layers = [_build(model, p, calls) for p in pieces]
    _check_keys(model, layers)
    return _unique_names(layers, pieces)


def cut_problem(model: nn.Module) -> str:
    """Why ``model`` is one layer to the pipeline: the reason ``traced_layers`` gives, in one line."""
    try:
        layers = traced_layers(model)
    except NotCuttable as e:
        return str(e)
    return f"its flat view has {len(layers)} pieces"


def _short(e: BaseException, limit: int = 140) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0].strip()
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _trace(model: nn.Module) -> fx.Graph:
    """The traced graph of ``model``'s forward, the same in training and in evaluation mode (a forward
    that reads ``self.training`` traces to two graphs: pieces traced in one mode would run the other
    mode wrongly). Raises NotCuttable with fx's error shortened."""
    was_training = model.training
    codes = []
    try:
        for mode in (True, False):
            model.train(mode)
            try:
                traced = fx.symbolic_trace(model)
            except Exception as e:  # noqa: BLE001 - any tracing failure means: cannot cut
                raise NotCuttable(
                    f"torch.fx cannot trace its forward ({type(e).__name__}: {_short(e)})") from None
            codes.append(traced.code)
    finally:
        model.train(was_training)
    if codes[0] != codes[1]:
        raise NotCuttable(
            "its traced forward differs between training and evaluation: it reads self.training")
    graph = traced.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise NotCuttable(f"its forward takes {len(inputs)} inputs, not one image batch")
    out = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(out.args[0], fx.Node):
        raise NotCuttable("its forward returns a tuple or dict, not one tensor")
    return graph


def _split(graph: fx.Graph) -> list[_Piece]:
    """The graph's compute nodes (get_attr nodes are parameters: they go with their users) cut after
    every node past which exactly one value is live."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((pos[u] for u in n.users), default=pos[n]) for n in nodes}
    live: set[fx.Node] = set()
    pieces, cur = [], _Piece()
    for i, n in enumerate(nodes):
        if n.op in ("get_attr", "output"):
            continue
        if n.op != "placeholder":
            cur.nodes.append(n)
        if last_use[n] > i:
            live.add(n)
        live -= {v for v in live if last_use[v] <= i}
        if len(live) == 1:
            (value,) = live
            if n.op == "placeholder":
                cur.src = value
                continue
            cur.dst = value
            pieces.append(cur)
            cur = _Piece(src=value)
    assert not cur.nodes, "the output's value is the only one live after the last node"
    return pieces


def _state_ids(model: nn.Module, piece: _Piece) -> set[int]:
    """Ids of the parameters and buffers ``piece``'s nodes read (through modules or get_attr)."""
    ids: set[int] = set()
    for n in piece.nodes:
        targets = [n.target] if n.op == "call_module" else []
        targets += [a.target for a in n.all_input_nodes if a.op == "get_attr"]
        for t in targets:
            obj = _attr(model, t)
            tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, nn.Module) else [obj]
            ids |= {id(x) for x in tensors if isinstance(x, torch.Tensor)}
    return ids


def _merge_tied(model: nn.Module, pieces: list[_Piece]) -> list[_Piece]:
    """``pieces`` with every run from the first to the last piece reading one parameter or buffer
    merged into one piece (tied weights stay on one stage)."""
    first: dict[int, int] = {}
    reach = list(range(len(pieces)))  # reach[i]: the last piece that must join piece i
    for i, p in enumerate(pieces):
        for t in _state_ids(model, p):
            j = first.setdefault(t, i)
            reach[j] = max(reach[j], i)
    out, i = [], 0
    while i < len(pieces):
        end, j = reach[i], i
        while j < end:
            j += 1
            end = max(end, reach[j])
        out += _join(pieces, i, end)[i:i + 1]
        i = end + 1
    return out


def _join(pieces: list[_Piece], lo: int, hi: int) -> list[_Piece]:
    """``pieces`` with ``pieces[lo..hi]`` (inclusive) made one piece."""
    merged = _Piece(nodes=[n for p in pieces[lo:hi + 1] for n in p.nodes], src=pieces[lo].src,
                    dst=pieces[hi].dst)
    return [*pieces[:lo], merged, *pieces[hi + 1:]]


def _coarsen(model: nn.Module, pieces: list[_Piece], calls) -> list[_Piece]:
    """``pieces`` where a piece that is not one whole submodule call (the add and the last ReLU of a
    residual block, a functional op inside a block) is merged with the other pieces of the innermost
    module call that contains it and more: a block is cut only into whole calls of its own submodules."""
    i = 0
    while i < len(pieces):
        p = pieces[i]
        if _whole_call(model, p, calls) is not None:
            i += 1
            continue
        common = [k for k in (p.nodes[0].meta.get("nn_module_stack") or {})
                  if all(k in (n.meta.get("nn_module_stack") or {}) for n in p.nodes)]
        nodes = set(p.nodes)
        key = next((k for k in reversed(common) if calls[k][1] > nodes), None)
        if key is None:
            i += 1
            continue
        members = calls[key][1]
        hit = [j for j, q in enumerate(pieces) if members & set(q.nodes)]
        pieces = _join(pieces, hit[0], hit[-1])
        i = hit[0]
    return pieces


def _module_calls(graph: fx.Graph) -> dict[str, tuple[str, set[fx.Node]]]:
    """Each module call fx saw (its ``nn_module_stack`` key, unique per call): (path, compute nodes)."""
    calls: dict[str, tuple[str, set[fx.Node]]] = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        for key, (path, _) in (n.meta.get("nn_module_stack") or {}).items():
            calls.setdefault(key, (path, set()))[1].add(n)
    return calls


def _whole_call(model: nn.Module, piece: _Piece, calls) -> Optional[str]:
    """The path of the deepest submodule whose one call is exactly ``piece`` and takes only the piece's
    input (a leaf module called as ``m(x)``, or a module whose forward has one parameter), else None."""
    stack = piece.nodes[0].meta.get("nn_module_stack") or {}
    nodes = set(piece.nodes)
    for key in reversed(list(stack)):
        path, members = calls[key]
        if members != nodes or not path:
            continue
        if len(piece.nodes) == 1 and piece.nodes[0].op == "call_module":
            n = piece.nodes[0]
            return path if n.args == (piece.src,) and not n.kwargs else None
        params = list(inspect.signature(model.get_submodule(path).forward).parameters.values())
        one = len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                      params[0].POSITIONAL_OR_KEYWORD)
        return path if one and piece.src in piece.nodes[0].all_input_nodes else None
    return None


def _build(model: nn.Module, piece: _Piece, calls) -> tuple[str, nn.Module]:
    """(name, module) of one piece: the user's submodule, ``nn.Flatten``, or a GraphModule of the piece."""
    path = _whole_call(model, piece, calls)
    if path is not None:
        return path, model.get_submodule(path)
    n = piece.nodes[0]
    if len(piece.nodes) == 1 and n.op == "call_function" and n.args[:1] == (piece.src,):
        module = _module_form(n)
        if module is not None:
            return n.name, module
    return _graph_module(model, piece)


# Functional calls that have a module form the filter split knows: name -> (module, its arguments in order)
_FUNCTIONAL = {
    nn.functional.max_pool2d: (nn.MaxPool2d, ("kernel_size", "stride", "padding", "dilation", "ceil_mode")),
    nn.functional.avg_pool2d: (nn.AvgPool2d, ("kernel_size", "stride", "padding", "ceil_mode",
                                              "count_include_pad")),
    nn.functional.adaptive_avg_pool2d: (nn.AdaptiveAvgPool2d, ("output_size",)),
    nn.functional.adaptive_max_pool2d: (nn.AdaptiveMaxPool2d, ("output_size",)),
}


def _module_form(n: fx.Node) -> Optional[nn.Module]:
    """``torch.flatten(x, d)`` as ``nn.Flatten(d)``, ``torch.relu(x)`` / ``F.relu(x)`` as ``nn.ReLU``,
    ``F.max_pool2d`` / ``avg_pool2d`` / ``adaptive_*_pool2d`` as their modules (layers the filter split
    knows), else None (also for arguments that are not constants)."""
    if n.target is torch.flatten:
        args = dict(zip(("input", "start_dim", "end_dim"), n.args), **n.kwargs)
        if set(args) <= {"input", "start_dim", "end_dim"}:
            return nn.Flatten(args.get("start_dim", 0), args.get("end_dim", -1))
    if n.target in (torch.relu, nn.functional.relu):
        args = dict(zip(("input", "inplace"), n.args), **n.kwargs)
        if set(args) <= ({"input", "inplace"} if n.target is nn.functional.relu else {"input"}):
            return nn.ReLU(inplace=bool(args.get("inplace", False)))
    if n.target in _FUNCTIONAL:
        module, names = _FUNCTIONAL[n.target]
        args = dict(zip(names, n.args[1:]), **n.kwargs)
        if args.get("return_indices") is False:   # (the traced call spells out the default)
            del args["return_indices"]
        if set(args) <= set(names) and not any(isinstance(v, fx.Node) for v in args.values()):
            return module(**args)
    return None


def _graph_module(model: nn.Module, piece: _Piece) -> tuple[str, nn.Module]:
    """The piece as a GraphModule rooted at the deepest submodule holding every module and tensor it
    reads (name: that submodule's path; targets relative to it); non-persistent buffers stay so."""
    used = [n for n in piece.nodes if n.op == "call_module"]
    attrs = list(dict.fromkeys(a for n in piece.nodes for a in n.all_input_nodes if a.op == "get_attr"))
    parents = [t.split(".")[:-1] for t in (n.target for n in [*used, *attrs])]
    prefix: list[str] = []
    for parts in zip(*parents) if parents else ():
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    root_path = ".".join(prefix)
    cut = len(root_path) + 1 if root_path else 0
    g = fx.Graph()
    env = {piece.src: g.placeholder("x")}
    for a in attrs:
        env[a] = g.get_attr(a.target[cut:])
    for n in piece.nodes:
        env[n] = g.node_copy(n, lambda v: env[v])
        if n.op == "call_module":
            env[n].target = n.target[cut:]
    g.output(env[piece.dst])
    root = model.get_submodule(root_path)
    gm = fx.GraphModule(root, g, class_name=f"Piece_{piece.nodes[-1].name}")
    for a in attrs:
        owner_path, _, leaf = a.target.rpartition(".")
        if leaf in model.get_submodule(owner_path)._non_persistent_buffers_set:
            gm.get_submodule(owner_path[cut:] if owner_path else "")._non_persistent_buffers_set.add(leaf)
    return (root_path if (used or attrs) else piece.nodes[-1].name), gm


def _attr(model: nn.Module, target: str):
    owner, _, leaf = target.rpartition(".")
    return getattr(model.get_submodule(owner), leaf)


def _check_keys(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
    """Raise NotCuttable unless the pieces' prefixed state_dict keys are exactly the model's (a
    parameter its forward never reads would be lost from the saved model)."""
    got = {f"{name}.{k}" if name else k for name, m in layers for k in m.state_dict()}
    want = set(model.state_dict())
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        what = (
            f"its forward never reads {missing[0]}"
            if missing
            else f"a piece holds {extra[0]}, not in the model"
        )
        raise NotCuttable(what)


def _unique_names(layers: list[tuple[str, nn.Module]], pieces: list[_Piece]) -> list[tuple[str, nn.Module]]:
    """Layer names made unique: a piece without parameters or buffers that repeats a name is named by
    its last node (fx node names are unique); the name of a piece with state is its key prefix."""
    seen: set[str] = set()
    out = []
    for (name, m), p in zip(layers, pieces):
        if name in seen and not any(True for _ in m.state_dict()):
            name = p.nodes[-1].name
        seen.add(name)
        out.append((name, m))
    return out

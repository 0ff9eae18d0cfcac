"""The planner's measurements: what ``planner.costmodel`` needs, measured on the device and cached.

Part of the planner (``python -m rayconv.plan``, ``--layout auto``): ``planner.costmodel`` is the
model of a step, ``planner.search`` the search.

What is measured, on the device the run will use:

* the model's profile (per-layer output sizes, parameters, FLOPs, where a filter split gathers),
  from one CPU forward of one sample (``parallel.routing.layer_profile``, ``filter_split.slice_layers``);
* each layer's forward + backward time at every batch size the candidate layouts need
  (``planner.layer_timing.layer_times``, what ``--balance time`` measures), on one GPU of the cluster
  (``cluster.tasks.run_on_device``) or on this process's CPU;
* with two or more GPUs, all-reduce, all-gather and send/recv times between two actors on the
  cluster (``cluster.tasks.run_on_devices``), fitted to latency + bytes / bandwidth; on one device or on
  CPU the links come from ``LINK_TABLE``.

Measurements are cached as JSON under ``$RAYCONV_CACHE_DIR`` (default ``~/.cache/rayconv/``), one file
per (model, data and its folder, image size, classes, device name, precision), with the time (UTC) and
machine of its last measurement; a second plan reads it, says when and where it was measured
(``Measurements.reused``) and measures nothing new; ``load(remeasure=True)`` ignores it.

Machines we cannot run on are predicted from the link table (``planner.links.MACHINES``,
``--machine``) with the per-layer times of the device at hand.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from rayconv.cluster.connect import available_devices, connect
from rayconv.cluster.tasks import run_on_device, run_on_devices
from rayconv.config import Config
from rayconv.data.registry import check_source
from rayconv.errors import LayoutError
from rayconv.files import atomic_write, cache_dir
from rayconv.models import run_model, to_layers
from rayconv.parallel import comm
from rayconv.user_model import model_label
from rayconv.parallel.filter_split.exchanges import Gather, Scatter
from rayconv.parallel.filter_split.layers import SlicedDropout
from rayconv.parallel.filter_split.split import slice_layers
from rayconv.parallel.routing import layer_profile
from rayconv.planner.layer_timing import layer_times, measured_costs
from rayconv.planner.links import LINK_TABLE, Links, LinkSpeed
from rayconv.planner.profile import Profile


# ---------------------------------------------------------------------- measurement (runs on the device)
def profile_of(cfg_dict: dict) -> dict:
    """The model's ``Profile`` fields (JSON-able) for the run settings ``cfg_dict``; runs on CPU."""
    cfg = Config(**cfg_dict)
    source = check_source(cfg)   # (its shapes only: a set in a bucket is not fetched for them)
    layers = to_layers(run_model(cfg, source))
    shapes, flops, params = layer_profile(layers, tuple(source.sample_shape))
    names = [n for n, _ in layers]
    first_fc = next((i for i, (_, m) in enumerate(layers) if isinstance(m, nn.Linear)), None)
    gathers: list[int] = []
    max_fs = 1
    try:
        part = slice_layers(layers, tuple(source.sample_shape), list(shapes), None, 0, 2, None, is_last=True)
        for j, m in enumerate(part.modules):
            if isinstance(m, Gather) and j + 1 < len(part.names) and part.names[j + 1] is not None:
                gathers.append(names.index(part.names[j + 1]))
        widths = [m.out_channels if isinstance(m, nn.Conv2d) else m.out_features for _, m in layers
                  if isinstance(m, (nn.Conv2d, nn.Linear))]
        max_fs = min(widths)
    except LayoutError:
        pass
    return {"model": cfg.model, "in_elems": math.prod(source.sample_shape),
            "out_elems": [math.prod(s) for s in shapes], "params": params, "first_fc": first_fc,
            "gathers": gathers, "max_fs": max_fs, "flops": flops,
            "saved_elems": saved_elems(layers, tuple(source.sample_shape))}


def saved_elems(layers, sample_shape: tuple[int, ...], batch: int = 2) -> list[float]:
    """Elements each layer saves for its backward pass, per sample (activations, masks, indices; its
    own parameters not counted): autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``)
    in one training-mode CPU forward of ``batch`` samples, each storage counted once."""
    x = torch.zeros((batch, *sample_shape))
    out = []
    for _, m in layers:
        own = {p.data_ptr() for p in m.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            if t.data_ptr() not in own:
                seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel())
            return t

        was = m.training
        m.train()
        inp = x.detach().requires_grad_() * 1  # (non-leaf: a layer may start with an in-place ReLU)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(inp)
        m.train(was)
        out.append(sum(seen.values()) / batch)
        x = y.detach()
    return out


def device_name(cfg_dict: dict) -> str:
    """This process's device as the cache names it (e.g. ``NVIDIA H200``, ``cpu-x86_64-2``)."""
    if cfg_dict["device"] == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"


def times_key(batch: int, fs: int) -> str:
    return str(batch) if fs == 1 else f"{batch}/fs{fs}"


def times_at(cfg_dict: dict, pairs: Sequence[tuple[int, int]]) -> dict:
    """Forward + backward ms per layer at each (batch size, fs): whole layers
    (``planner.layer_timing.measured_costs``, what ``--balance time`` measures) for fs = 1, else one actor's
    slice of the filter split (``sliced_costs``). Returns {"device": name, "times": {key: [ms, ...]}}."""
    return {"device": device_name(cfg_dict), "times": {times_key(b, fs): measured_costs(cfg_dict, b)
                                                       if fs == 1 else sliced_costs(cfg_dict, b, fs)
                                                       for b, fs in pairs}}


class LocalGather(nn.Module):
    """A filter split's gather done locally: the gathered shape, from this slice and zeros."""

    def __init__(self, dim: int, sizes: list[int]):
        super().__init__()
        self.dim, self.rest = dim, sum(sizes) - sizes[0]

    def forward(self, x):
        pad = list(x.shape)
        pad[self.dim] = self.rest
        return torch.cat([x, x.new_zeros(pad)], dim=self.dim)


class LocalScatter(nn.Module):
    """A filter split's scatter done locally: this actor's slice."""

    def __init__(self, dim: int, size: int):
        super().__init__()
        self.dim, self.size = dim, size

    def forward(self, x):
        return x.narrow(self.dim, 0, self.size).contiguous()


def sliced_costs(cfg_dict: dict, batch: int, fs: int) -> list[float]:
    """Forward + backward ms of actor 0's slice of each layer under a filter split over ``fs``
    (``filter_split.slice_layers``), at ``batch`` images, on this process's device, one per layer of
    ``models.to_layers``. The split's collectives are timed apart (``planner.links.Links``): here each
    gather is a local copy to the gathered shape and each scatter a local slice, so that the layers
    after them see the shapes they see in the run; their copy time counts to the layer after them."""
    cfg = Config(**cfg_dict)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    source = check_source(cfg)   # (its shapes only: a set in a bucket is not fetched for them)
    layers = to_layers(run_model(cfg, source))
    shapes, _, _ = layer_profile(layers, tuple(source.sample_shape), count_flops=False)
    part = slice_layers(layers, tuple(source.sample_shape), list(shapes), None, 0, fs, None, is_last=True)
    names = [n for n, _ in layers]
    seq, owner = [], []
    for m, name in zip(part.modules, part.names):
        if isinstance(m, Gather):
            m = LocalGather(m.dim, m.sizes)
        elif isinstance(m, Scatter):
            m = LocalScatter(m.dim, m.sizes[0])
        elif isinstance(m, SlicedDropout):
            m.reseed(0, device)
        seq.append((name or "", m))
        owner.append(None if name is None else names.index(name))
    ms = layer_times(seq, tuple(source.sample_shape), batch, device,
                     torch.bfloat16 if cfg.precision == "bf16" else None)
    out = [0.0] * len(layers)
    carry = 0.0
    for i, t in zip(owner, ms):
        if i is None:
            carry += t
        else:
            out[i] += t + carry
            carry = 0.0
    out[-1] += carry  # the logits' gather
    return out


def link_probe(rank: int, world: int, master: str, backend: str, sizes_mb: Sequence[float]) -> dict:
    """Median times (ms) of all-reduce, all-gather (each rank gives size / world) and a one-way send of
    each size (MB) between ``world`` processes (run by ``cluster.tasks.run_on_devices``)."""
    comm.join_world(master, rank, world, backend, 60.0)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    out: dict[str, list] = {"sizes_mb": list(sizes_mb), "allreduce": [], "allgather": [], "p2p": []}
    try:
        for mb in sizes_mb:
            n = max(world, int(mb * 2**20 // 4) // world * world)
            t = torch.ones(n, device=dev)
            parts = list(torch.empty(n, device=dev).chunk(world))
            ops = {"allreduce": lambda: dist.all_reduce(t),
                   "allgather": lambda: dist.all_gather(parts, t[:n // world].clone()),
                   # a round trip between ranks 0 and 1, halved below
                   "p2p": lambda: (dist.send(t, 1), dist.recv(t, 1)) if rank == 0 else
                   ((dist.recv(t, 0), dist.send(t, 0)) if rank == 1 else None)}
            for key, op in ops.items():
                times = []
                for i in range(7):
                    sync()
                    t0 = time.perf_counter()
                    op()
                    sync()
                    if i >= 2:
                        times.append((time.perf_counter() - t0) * 1e3)
                out[key].append(statistics.median(times) / (2 if key == "p2p" else 1))
    finally:
        dist.destroy_process_group()
    return out


def fit_links(probe: dict, world: int, name: str) -> Links:
    """Latency + bandwidth per transfer kind, least squares over the probed sizes (bus bytes for
    collectives, as ``planner.links.LinkSpeed`` counts them)."""
    def fit(key: str, factor: float) -> LinkSpeed:
        xs = [mb * 2**20 * factor for mb in probe["sizes_mb"]]
        ys = probe[key]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-30, sum((x - mx) ** 2 for x in xs))
        slope = max(slope, 1e-12)
        return LinkSpeed(gbps=1e3 / slope / 1e9, latency_ms=max(0.0, my - slope * mx))

    n = world
    speeds = (fit("allreduce", 2 * (n - 1) / n), fit("allgather", (n - 1) / n), fit("p2p", 1.0))
    return Links(
        name, *speeds, gpus_per_node=max(world, 8),
        source=f"measured between {world} actors: all-reduce {speeds[0].gbps:.1f} GB/s, all-gather "
        f"{speeds[1].gbps:.1f} GB/s, send/recv {speeds[2].gbps:.1f} GB/s (bus bandwidth, fitted)")


# ---------------------------------------------------------------------- cache
class Measurements:
    """Profile, layer times and links of one (model, data shape, device, precision), cached on disk."""

    def __init__(self, cfg: Config, device: str, use_cluster: bool,
                 log: Optional[Callable[[str], None]] = None):
        self.cfg, self.device, self.use_cluster = cfg, device, use_cluster
        self.log = log or (lambda _: None)   # the progress of the layer times' measuring, a line each
        self.cfg_dict = {**cfg.to_dict(), "device": device}
        self.state: dict[str, Any] = {"times": {}, "links": None, "device": None, "profile": None}
        self.path: Optional[Path] = None
        self.measured: list[str] = []
        self.reused: Optional[str] = None  # the line saying whose cache is reused (None: measured here)

    def _run(self, fn, args: Sequence[Any]):
        if self.use_cluster:
            return run_on_device(fn, args, gpu=self.device == "cuda", timeout_s=600.0, model=self.cfg.model)
        threads = torch.get_num_threads()
        if self.device == "cpu":  # as an actor computes: --num-cpus-per-actor threads (worker.py)
            torch.set_num_threads(max(1, self.cfg.num_cpus_per_actor))
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(threads)

    def load(self, remeasure: bool = False) -> None:
        """Find this configuration's cache file (asks the device for its name first) and read it, unless
        ``remeasure`` (then everything is measured again and the file replaced on ``save``); a file read
        sets ``reused`` to a line naming its time and machine."""
        name = self._run(device_name, (self.cfg_dict,))
        key = json.dumps([self.cfg.model, self.cfg.data, self.cfg.data_dir, self.cfg.image_size,
                          self.cfg.num_classes, name, self.cfg.precision])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        # (a path spec has slashes)
        self.path = cache_dir() / f"plan-{model_label(self.cfg.model)}-{digest}.json"
        if self.path.is_file() and not remeasure:
            try:
                self.state = json.loads(self.path.read_text())
                made, machine = self.state.get("measured_at"), self.state.get("machine")
                self.reused = (f"reusing measurements made {made or 'at an unknown time'} on "
                               f"{machine or 'an unknown machine'} ({self.path}; --remeasure of "
                               "python -m rayconv.plan measures anew)")
            except (OSError, ValueError):
                pass  # a damaged cache is measured again
        self.state["device"] = name

    def save(self) -> None:
        """Write the cache file; when something was measured, stamped with the time (UTC) and machine."""
        assert self.path is not None
        if self.measured:
            self.state["measured_at"] = datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"
            )
            self.state["machine"] = platform.node()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, lambda tmp: Path(tmp).write_text(json.dumps(self.state)))

    def profile(self) -> Profile:
        if self.state.get("profile") is None:
            self.state["profile"] = profile_of(self.cfg_dict)
            self.measured.append("profile")
        p = self.state["profile"]
        return Profile(p["model"], p["in_elems"], tuple(p["out_elems"]), tuple(p["params"]), p["first_fc"],
                       tuple(p["gathers"]), p["max_fs"], tuple(p["flops"]), tuple(p["saved_elems"]))

    def times(self, pairs: Sequence[tuple[int, int]]) -> Callable[[int, int], list[float]]:
        """Measure the (batch, fs) pairs not cached yet; return (batch, fs) -> per-layer ms."""
        missing = [(b, fs) for b, fs in pairs if times_key(b, fs) not in self.state["times"]]
        if missing:
            keys = [times_key(b, fs) for b, fs in missing]
            self.log(
                "planner: measuring forward + backward time per layer on"
                f" {self.state['device'] or self.device} at {len(missing)} batch"
                f" size{'s' * (len(missing) > 1)} (/fsK: a filter split's slice):"
                f" {', '.join(keys)}{' (one task on the cluster)' if self.use_cluster else ''}"
            )
            t0 = time.perf_counter()
            if self.use_cluster:   # (one task: each would start a worker and build the model anew)
                self.state["times"].update(self._run(times_at, (self.cfg_dict, missing))["times"])
            else:
                for k, pair in enumerate(missing, 1):
                    t = time.perf_counter()
                    self.state["times"].update(self._run(times_at, (self.cfg_dict, [pair]))["times"])
                    self.log(
                        f"planner: [{k}/{len(missing)}] batch {keys[k - 1]}: {time.perf_counter() - t:.1f} s")
            self.log(f"planner: layer times measured in {time.perf_counter() - t0:.1f} s")
            self.measured.append("layer times at batch " + ", ".join(keys))
        table = self.state["times"]
        return lambda b, fs=1: table[times_key(b, fs)]

    def links(self, world: int) -> Links:
        """Measured between two GPU actors when the cluster (``--address``, else a local Ray) has two
        or more GPUs, cached per cluster; else the link table."""
        if self.device == "cuda" and world >= 2:
            connect(self.cfg.address)
            if available_devices("cuda")[1] >= 2:
                where = f"{self.cfg.address or 'local'}@{platform.node()}"
                measured = self.state.setdefault("links", None) or {}
                if where not in measured:
                    measured[where] = run_on_devices(link_probe, 2, True, ("nccl", (1, 8, 32)))[0]
                    self.measured.append("links")
                self.state["links"] = measured
                return fit_links(measured[where], 2, f"{self.state['device']} x {world}")
        key = "nvlink4" if self.device == "cuda" else "gloo-loopback"
        text, speed = LINK_TABLE[key]
        return Links(key, speed, speed, speed, gpus_per_node=max(world, 1), source=f"link table: {text}")

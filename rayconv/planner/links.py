"""Transfer speeds between actors: the cost model's links, and the link table of machines not at hand.

``LinkSpeed`` prices one kind of transfer as latency + bytes / bandwidth; ``Links`` holds the kinds
a step uses (all-reduce, all-gather / reduce-scatter, point-to-point) inside a node and between nodes.
``planner.measure.fit_links`` fits them to timings between two actors; ``MACHINES`` (``python -m
rayconv.plan --machine``) assumes them from ``LINK_TABLE``: rates NCCL is assumed to achieve, below the
links' datasheet rates, whose sources are:

* NVLink 4 / NVSwitch on H100/H200 (``NVLINK4``): NVIDIA H200 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/h200/ ; HGX H200 boards connect all 8 GPUs through NVSwitch,
  https://www.nvidia.com/en-us/data-center/hgx/ . How the assumed rate compares with a measured
  all-reduce between two actors: benchmarks/RESULTS.md, "The link table's NVLink figure".
* Between hosts (``IB_NDR``): InfiniBand NDR, one ConnectX-7 adapter per GPU as in DGX/HGX H200 systems
  (NVIDIA ConnectX-7 datasheet, https://www.nvidia.com/en-us/networking/ethernet-adapters/ ; DGX H200
  user guide).
* gloo between CPU processes over loopback TCP (``GLOO_LOOPBACK``): a rough rate for the CPU's plans.

The rates themselves are the constants below (not restated in prose); measured ones are in
benchmarks/RESULTS.md.

Imports nothing of the package: ``python -m rayconv.plan``'s argument parsing reads ``MACHINES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class LinkSpeed:
    """One kind of transfer: time(ms) = ``latency_ms`` + bytes / (``gbps`` x 1e9) x 1e3, where for
    collectives over n actors the bytes are NCCL's bus bytes: all-reduce 2 (n - 1) / n x size,
    all-gather / reduce-scatter (n - 1) / n x the gathered size."""

    gbps: float
    latency_ms: float = 0.0

    def ms(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_ms + nbytes / (self.gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Links:
    """Transfer speeds of a machine: ``intra`` inside a node, ``inter`` between nodes (None: one
    node), ``gpus_per_node`` actors per node (ranks fill nodes in order, as the placement group packs
    them). ``source`` says where the figures come from (measured, or a datasheet)."""

    name: str
    allreduce: LinkSpeed
    allgather: LinkSpeed
    p2p: LinkSpeed
    gpus_per_node: int = 8
    inter: Optional[LinkSpeed] = None
    source: str = ""

    def _spans(self, ranks: Sequence[int]) -> bool:
        return len({r // self.gpus_per_node for r in ranks}) > 1

    def allreduce_ms(self, nbytes: float, ranks: Sequence[int]) -> float:
        n = len(ranks)
        if n < 2:
            return 0.0
        speed = self.inter if self.inter is not None and self._spans(ranks) else self.allreduce
        return speed.ms(2 * (n - 1) / n * nbytes)

    def allgather_ms(self, nbytes: float, ranks: Sequence[int]) -> float:
        n = len(ranks)
        if n < 2:
            return 0.0
        speed = self.inter if self.inter is not None and self._spans(ranks) else self.allgather
        return speed.ms((n - 1) / n * nbytes)

    def p2p_ms(self, nbytes: float, a: int, b: int) -> float:
        speed = self.inter if self.inter is not None and self._spans([a, b]) else self.p2p
        return speed.ms(nbytes)


NVLINK4 = LinkSpeed(gbps=290.0, latency_ms=0.02)
IB_NDR = LinkSpeed(gbps=40.0, latency_ms=0.03)
GLOO_LOOPBACK = LinkSpeed(gbps=1.0, latency_ms=0.1)


def _assumed(speed: LinkSpeed) -> str:
    """A table entry's rate in words, from its constant."""
    return f"{speed.gbps:g} GB/s and {speed.latency_ms:g} ms assumed achieved"


LINK_TABLE = {
    "nvlink4": (f"NVLink 4 / NVSwitch (H100/H200 HGX), {_assumed(NVLINK4)}", NVLINK4),
    "gloo-loopback": (f"gloo over loopback TCP between CPU processes, {_assumed(GLOO_LOOPBACK)}",
                      GLOO_LOOPBACK),
}


@dataclass(frozen=True)
class Machine:
    """A machine to predict for: ``nodes`` hosts of ``gpus_per_node`` GPUs and their links."""

    name: str
    nodes: int
    gpus_per_node: int
    intra: str
    inter: Optional[LinkSpeed] = None

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def links(self) -> Links:
        text, speed = LINK_TABLE[self.intra]
        inter = f"; between hosts InfiniBand NDR, {_assumed(self.inter)} per GPU" if self.inter else ""
        return Links(self.name, speed, speed, speed, self.gpus_per_node, self.inter,
                     source=f"link table: {text}{inter}")


MACHINES = {
    "h200x2": Machine("2 x H200, one host", 1, 2, "nvlink4"),
    "h200x4": Machine("4 x H200, one host", 1, 4, "nvlink4"),
    "h200x8": Machine("8 x H200, one host (HGX, NVSwitch)", 1, 8, "nvlink4"),
    "2xh200x8": Machine("2 hosts of 8 x H200 (InfiniBand NDR)", 2, 8, "nvlink4", IB_NDR),
}

__all__ = ["LinkSpeed", "Links", "Machine", "MACHINES", "LINK_TABLE", "NVLINK4", "IB_NDR", "GLOO_LOOPBACK"]

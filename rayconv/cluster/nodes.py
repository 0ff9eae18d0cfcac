"""The cluster's nodes as --elastic reads them: the actor slots free, and the nodes being drained
(``ray drain-node``, a cloud's preemption notice through the autoscaler).

Both come from one read of the cluster's status (``ray.autoscaler.v2.sdk.get_cluster_status``, what
``ray status`` prints): each live node's status (RUNNING, IDLE, DRAINING) and its free resources.
"""

from __future__ import annotations

import ray


def free_devices(per_node: dict[str, dict[str, float]], draining: set[str], device: str,
                 per_actor: int) -> int:
    """Actor slots free on the nodes ``per_node`` (node id -> available resources) that are not
    ``draining``: GPUs (with a CPU each) for cuda, ``per_actor`` CPUs each for cpu."""
    slots = 0
    for node, res in per_node.items():
        if node in draining:
            continue
        cpus = int(res.get("CPU", 0) + 1e-9)
        slots += min(int(res.get("GPU", 0) + 1e-9), cpus) if device == "cuda" else cpus // max(1, per_actor)
    return slots


def _live_nodes() -> list:
    from ray.autoscaler.v2.sdk import get_cluster_status   # (an elastic run's alone: 17 modules at start-up)
    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    return list(status.active_nodes) + list(status.idle_nodes)


def draining_nodes() -> set[str]:
    """Hex ids of the live nodes being drained."""
    return {n.node_id for n in _live_nodes() if n.node_status == "DRAINING"}


def free_slots(device: str, per_actor: int) -> int:
    """The connected cluster's free actor slots for ``device`` ("cpu": ``per_actor`` CPUs each; "cuda":
    a GPU and a CPU each), draining nodes left out."""
    nodes = _live_nodes()
    per_node = {n.node_id: n.available_resources() for n in nodes}
    draining = {n.node_id for n in nodes if n.node_status == "DRAINING"}
    return free_devices(per_node, draining, device, per_actor)

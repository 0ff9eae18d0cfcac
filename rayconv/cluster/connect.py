"""Connecting to a Ray cluster and asking it what it has; the small Ray helpers the rest of cluster/ shares.

``connect`` finds or starts the cluster (``probe`` refuses, in one line, an address where no Ray
answers; ``cluster_origin`` says which it did, ``cluster_outlives_process`` whether it stays after
this process); ``available_devices`` counts the slots an actor can
take (GPUs, or CPUs); ``node_memory_share`` the memory CPU actors share on a node; ``visible_index``
maps the GPU id Ray assigned to torch's device index; ``exception_summary`` and ``first_line`` turn
Ray's multi-line errors into the one line a user reads.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Optional

import ray

from rayconv.errors import ClusterError, ConfigError, DataError, LayoutError

NAMESPACE = "rayconv"
# Actors and tasks with this see every GPU of their node (and select theirs by ``visible_index``).
ALL_GPUS_VISIBLE_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
# Seconds ``probe`` gives a cluster address to accept a connection, then to answer a gRPC call.
PROBE_TIMEOUT_S = 5.0
PROBE_METHOD = "/rayconv.Probe/Handshake"   # (no such method: a gRPC server answers UNIMPLEMENTED)


def connect(address: Optional[str], quiet: bool = True, min_cpus: Optional[int] = None) -> str:
    """Connect to the cluster at ``address``, else to RAY_ADDRESS or a running local cluster
    (``ray start --head``), else start a local one (dashboard on 127.0.0.1). A local one started
    here gets at least ``min_cpus`` logical CPUs, so that a layout with more CPU actors than cores
    (``--dp 2 --fs 2`` on a 2-core laptop) still runs, oversubscribed. Raises ConfigError for an address
    where no Ray cluster answers, ClusterError when Ray cannot connect. Returns how: "reused" (this
    process was connected already: the connection is kept, and a cluster it started runs until the
    process exits, Ray's own atexit), "connected" or "started" (a local cluster of this process)."""
    probe(address or os.environ.get("RAY_ADDRESS"))
    if ray.is_initialized():
        _HOW["last"] = "reused"
        return "reused"
    kw = dict(address=address, namespace=NAMESPACE, log_to_driver=not quiet, configure_logging=True,
              logging_level="WARNING")
    # What this process imports right after connecting (Ray's serialization context, at the first
    # placement group or actor: numpy and pyarrow), imported on a thread while ray.init waits on the
    # cluster (a local one starting: seconds), so that the first actors are asked for sooner.
    threading.Thread(target=_import_ahead, name="rayconv-import-ahead", daemon=True).start()
    extra: dict[str, Any] = {"num_cpus": min_cpus} if min_cpus and min_cpus > (os.cpu_count() or 1) else {}
    try:
        try:
            ray.init(**kw, **extra)
        except ValueError as e:
            if not extra or not any(k in str(e) for k in extra):
                raise
            ray.init(**kw)  # an existing cluster was found: its resources and settings are what they are
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        where = address or os.environ.get("RAY_ADDRESS") or "a local cluster"
        raise ClusterError(f"cannot connect to Ray at {where} ({e}): check --address / RAY_ADDRESS, "
                           "or run `ray start --head` first") from None
    node = getattr(ray._private.worker, "_global_node", None)  # (the head node's when ray.init started it)
    _HOW["last"] = "started" if getattr(node, "head", False) else "connected"
    _HOW["outlives"] = _gcs_address() if _HOW["last"] == "connected" else None
    return _HOW["last"]


def _import_ahead() -> None:
    """Import numpy and pyarrow (``connect``'s thread); a failure is met again where they are needed."""
    try:
        import numpy  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError:
        pass


# how the last ``connect`` of this process reached the cluster; "outlives": the GCS address of the
# cluster it last connected to without starting it
_HOW: dict[str, Optional[str]] = {}


def cluster_outlives_process() -> bool:
    """Whether the connected cluster goes on after this process ends: one it connected to (an
    address, RAY_ADDRESS, a running local cluster), not one it started; Ray Client's connections
    excluded (actors kept across commands need the driver's own GCS connection: ``cluster.across``)."""
    from ray.util.client import ray as client

    return not client.is_connected() and ray.is_initialized() and _HOW.get("outlives") == _gcs_address()


def _gcs_address() -> Optional[str]:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - Ray Client has no GCS client in the driver
        return None


def dashboard_url() -> Optional[str]:
    """The connected cluster's Ray dashboard (``http://host:port``, as Ray's node records it), None when it
    runs none or under Ray Client."""
    node = getattr(ray._private.worker, "_global_node", None) if ray.is_initialized() else None
    try:
        url = getattr(node, "webui_url", None)
    except Exception:  # noqa: BLE001 - not readable from this node: no line
        return None
    return (url if "://" in url else f"http://{url}") if url else None


def cluster_origin() -> str:
    """How this process reached the connected cluster, for the console: ``attached to the cluster at
    HOST:PORT`` (``--address``, RAY_ADDRESS, or one started by ``ray start``), or ``started a local
    cluster at HOST:PORT`` (it ends with this process). Told by whether this process runs the head."""
    node = getattr(ray._private.worker, "_global_node", None)   # (set by ray.init; None under Ray Client)
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - Ray Client has no GCS client in the driver
        address = os.environ.get("RAY_ADDRESS") or "a Ray Client server"
    if getattr(node, "head", False):
        if _HOW.get("last") == "reused":
            return f"reusing the local cluster this process started at {address} (it stops when this process ends)"
        return f"started a local cluster at {address} (it stops when this process ends)"
    return f"attached to the cluster at {address}"


def probe(address: Optional[str]) -> None:
    """Fail fast, in one line, on a ``host:port`` cluster address where no Ray GCS answers: nobody
    listening (Ray itself retries for minutes), or something other than Ray (Ray's GCS client then
    logs its RPC errors for as long). The GCS is a gRPC server, so it must answer a gRPC call: one to a
    method it does not have, which a gRPC server refuses at once (UNIMPLEMENTED) and anything else
    leaves unanswered. (A call, not ``grpc.channel_ready_future``: closing a channel whose connectivity
    was watched waits 0.2 s for the watcher.) The connection and the call get ``PROBE_TIMEOUT_S``
    seconds each. Raises ConfigError: the address is the user's to change."""
    timeout_s = PROBE_TIMEOUT_S
    if not address or "://" in address or address == "auto" or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    hint = ("check --address / RAY_ADDRESS (the head's GCS address, e.g. 10.0.0.5:6379), "
            "or run `ray start --head` first")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot reach a Ray cluster at {address} ({e}): {hint}") from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return  # the GCS speaks TLS first: a plain handshake would not get through
    import grpc  # (installed with Ray)

    channel = grpc.insecure_channel(address)
    try:
        channel.unary_unary(PROBE_METHOD)(b"", timeout=timeout_s, wait_for_ready=True)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            raise ConfigError(f"something answers at {address} but not a Ray cluster (no gRPC answer within "
                              f"{timeout_s:g} s): {hint}") from None
    finally:
        channel.close()


def available_devices(device: str) -> tuple[str, int]:
    """(resolved device kind, number of actor slots): GPUs for cuda, CPUs for cpu. Raises ConfigError."""
    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    if device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda but the Ray cluster has no GPUs: use --device cpu (or auto)")
    kind = "cuda" if device == "cuda" or (device == "auto" and gpus > 0) else "cpu"
    return kind, gpus if kind == "cuda" else int(res.get("CPU", 0))


def node_memory_share(nodes: list[dict[str, Any]], world: int, cpus_per_actor: int) -> tuple[int, int]:
    """(memory bytes, actors) of the node of ``nodes`` (``ray.nodes()``) that ``world`` CPU actors of
    ``cpus_per_actor`` CPUs each leave the least memory per actor, counting on each alive node as many
    actors as its CPUs take (up to ``world``: the placement group packs them). A node's memory is Ray's
    ``memory`` resource (what its tasks and actors may use)."""
    shares = []
    for node in nodes:
        res = node.get("Resources", {}) if node.get("Alive") else {}
        actors = min(world, int(res.get("CPU", 0)) // max(1, cpus_per_actor))
        if actors >= 1 and res.get("memory"):
            shares.append((int(res["memory"]), actors))
    return min(shares, key=lambda s: s[0] / s[1]) if shares else (0, world)


def visible_index(gpu_id: Any, visible: Optional[str] = None) -> int:
    """torch's device index of the GPU Ray calls ``gpu_id`` when this process sees the node's GPUs:
    Ray's ids are those of the node (its CUDA_VISIBLE_DEVICES, if the node was started with one), so a
    node started with CUDA_VISIBLE_DEVICES=2,3 calls its GPUs 2 and 3, which torch numbers 0 and 1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    listed = [v.strip() for v in visible.split(",")] if visible else []
    return listed.index(str(gpu_id)) if str(gpu_id) in listed else int(gpu_id)


def assigned_gpu_index() -> int:
    """torch's device index of the GPU Ray assigned this actor: found by ``visible_index`` where the actor
    sees every GPU of its node (its environment has ``ALL_GPUS_VISIBLE_ENV``: ``group.actors_env``), else
    0 (Ray narrowed CUDA_VISIBLE_DEVICES to it). Raises RuntimeError where Ray assigned none."""
    ids = ray.get_gpu_ids()
    if not ids:
        raise RuntimeError("actor has no GPU assigned by Ray")
    sees_all = all(os.environ.get(k) == v for k, v in ALL_GPUS_VISIBLE_ENV.items())
    return visible_index(ids[0]) if sees_all else 0


def innermost(e: BaseException) -> BaseException:
    """The innermost user-facing error in ``e`` (Ray wraps an actor's or a task's error in RayTaskError,
    possibly several deep)."""
    while isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    return e


def actor_error(line: str, e: BaseException, recoverable: bool) -> Exception:
    """The error to raise for an actor's failure ``e``, said in ``line``: bad input the actor's own code
    met (DataError: a file that does not decode; ConfigError, LayoutError) as its own type, which the
    command exits 2 for; else a ClusterError (``recoverable``: restarting the actors may help)."""
    cause = innermost(e)
    if isinstance(cause, (DataError, ConfigError, LayoutError)):
        return type(cause)(line)
    return ClusterError(line, recoverable=recoverable)


def exception_summary(e: BaseException) -> str:
    """The one-line message of the innermost user-facing error in ``e`` (``innermost``)."""
    cause = innermost(e)
    return f"{type(cause).__name__}: {cause}"


def first_line(e: BaseException) -> str:
    """The first line of a Ray error, without Ray's ``System error:`` prefix."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[0].removeprefix("System error: ")

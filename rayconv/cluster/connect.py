"""Connecting to a Ray cluster and asking it what it has; the small Ray helpers the rest of cluster/ shares.

``connect`` finds or starts the cluster, ``connect_run`` for a run with the logical CPUs its layout needs
(``probe`` refuses, in one line, an address where no Ray answers; ``cluster_origin`` says which it did,
``cluster_outlives_process`` whether it stays after this process, ``cli_address`` what a Ray command
line needs to reach it); ``available_devices`` counts
the slots an actor can take (GPUs, or CPUs); ``node_memory_share`` the memory CPU actors share on a node;
``visible_index`` maps the GPU id Ray assigned to torch's device index; ``exception_summary`` turns Ray's
multi-line errors into the one line a user reads (``errors.first_line``: their first line).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import ray

from rayconv import startup
from rayconv.cluster import host
from rayconv.errors import ClusterError, ConfigError, DataError, LayoutError

if TYPE_CHECKING:
    from rayconv.config import Config

NAMESPACE = "rayconv"
# Actors and tasks with this see every GPU of their node (and select theirs by ``visible_index``).
ALL_GPUS_VISIBLE_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
# Seconds ``probe`` gives a cluster address to accept a connection, then to answer a gRPC call.
PROBE_TIMEOUT_S = 5.0
PROBE_METHOD = "/rayconv.Probe/Handshake"   # (no such method: a gRPC server answers UNIMPLEMENTED)
NO_GPUS = "--device cuda but the Ray cluster has no GPUs: use --device cpu (or auto)"


def connect(address: Optional[str], quiet: bool = True, min_cpus: Optional[int] = None,
            gpus: bool = False) -> str:
    """Connect to the cluster ``find_cluster`` names (``--address``, RAY_ADDRESS, Ray's address file of a
    running ``ray start --head``), else start a local one (dashboard on 127.0.0.1). A local one started
    here gets at least ``min_cpus`` logical CPUs, so that a layout with more CPU actors than cores
    (``--dp 2 --fs 2`` on a 2-core laptop) still runs, oversubscribed. Raises ConfigError for an address
    where no Ray cluster answers, and, with ``gpus`` (the run needs GPUs), before a local cluster starts on
    a host without GPUs (``host.has_nvidia_gpu``; a cluster connected to is asked: ``available_devices``);
    ClusterError when Ray cannot connect. Returns how: "reused" (this process was connected already: the
    connection is kept, and a cluster it started runs until the process exits, Ray's own atexit),
    "connected" or "started" (a local cluster of this process)."""
    if ray.is_initialized():
        if address and address not in ("auto", "local") and not address.startswith("ray://") \
                and address != _gcs_address():
            probe(address)   # (an --address where no Ray answers is refused, connected or not)
        _HOW["last"] = "reused"
        return "reused"
    found, source = find_cluster(address)
    if found is not None and source.startswith("Ray's address file"):
        try:
            probe(found)
        except ConfigError:   # (a head that ended without `ray stop`: its file stays) a local cluster instead
            _HOW["stale"] = f"{source} names {found}, where no Ray answers"
            found, source = None, ""
    else:
        probe(found)
    if found is None and address != "auto" and gpus and not host.has_nvidia_gpu():
        raise ConfigError(NO_GPUS)   # (before Ray starts a local cluster: seconds, a minute on a loaded host)
    _HOW["source"] = source
    kw = dict(address=found or ("auto" if address == "auto" else "local"), namespace=NAMESPACE,
              log_to_driver=not quiet, configure_logging=True, logging_level="WARNING")
    # What this process imports right after connecting (Ray's serialization context, at the first
    # placement group or actor: numpy and pyarrow), imported on a thread while ray.init waits on the
    # cluster (a local one starting: seconds), so that the first actors are asked for sooner.
    threading.Thread(target=_import_ahead, name="rayconv-import-ahead", daemon=True).start()
    extra: dict[str, Any] = {"num_cpus": min_cpus} if (
        found is None and min_cpus and min_cpus > (os.cpu_count() or 1)) else {}
    try:
        context = ray.init(**kw, **extra)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        where = found or "a local cluster"
        raise ClusterError(f"cannot connect to Ray at {where} ({e}): check --address / RAY_ADDRESS, "
                           "or run `ray start --head` first") from None
    _HOW["last"] = "started" if kw["address"] == "local" else "connected"   # ("local": Ray starts one)
    _HOW["outlives"] = _gcs_address() if _HOW["last"] == "connected" else None
    _HOW["started"] = _gcs_address() if _HOW["last"] == "started" else None
    use_dashboard(context.dashboard_url)
    return _HOW["last"]


ADDRESS_FILE = "ray_current_cluster"   # what `ray start --head` writes into its temp dir: the GCS address


def connect_run(cfg: Config) -> None:
    """Connect Ray for the run in progress (``connect``: ``cluster_cpus``, ``gpus`` for --device cuda) and
    mark the start-up clock's ``ray`` with how; nothing when this run connected already (``driver.early``'s
    ``start_first``, then ``driver.resolve``). Raises ConfigError / ClusterError as ``connect`` does."""
    clock = startup.current()
    if clock is not None and "ray" in clock.phases and ray.is_initialized():
        return
    how = connect(cfg.address, min_cpus=cluster_cpus(cfg), gpus=cfg.device == "cuda")
    startup.mark("ray")
    if clock is not None:
        clock.ray = how


def cluster_cpus(cfg: Config) -> Optional[int]:
    """The logical CPUs a local cluster started for ``cfg`` gets at least (``connect``'s ``min_cpus``):
    one slot per CPU actor (``--dp`` left to the cluster: one replica); None for GPU runs."""
    if cfg.device == "cuda":
        return None
    return (cfg.dp or 1) * cfg.pp * cfg.fs * cfg.num_cpus_per_actor


def address_files() -> list[Path]:
    """Where ``find_cluster`` reads Ray's address file, in order: Ray's default temp dir (``ray`` under
    RAY_TMPDIR, else under TMPDIR, else /tmp/ray: where ``ray.init()`` itself looks), then RAY_TMPDIR
    itself (the folder ``ray start --head --temp-dir $RAY_TMPDIR`` wrote it into)."""
    system = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    dirs = [Path(system) / "ray"] + ([Path(os.environ["RAY_TMPDIR"])] if os.environ.get("RAY_TMPDIR") else [])
    return [d / ADDRESS_FILE for d in dirs]


def find_cluster(address: Optional[str]) -> tuple[Optional[str], str]:
    """(the cluster's address, how it was found) as Ray finds it, plus the ``--temp-dir`` that RAY_TMPDIR
    names: ``address`` (``--address``; "auto" is as none here, then Ray's own "auto"), else RAY_ADDRESS,
    else the address file of a running ``ray start --head`` (``address_files``); (None, "") when none
    names one: the caller starts a local cluster."""
    if address and address != "auto":
        return address, "--address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    for path in address_files():
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return text, f"Ray's address file {path}"
    return None, ""


def other_clusters() -> list[str]:
    """The GCS addresses of the Ray clusters with a node on this host other than the connected one (the
    process table: ``host.gcs_addresses``, where Ray's ``ray.init(address="auto")`` looks too)."""
    return sorted(host.gcs_addresses() - {_gcs_address()})


def _import_ahead() -> None:
    """Import numpy and pyarrow (``connect``'s thread); a failure is met again where they are needed."""
    try:
        import numpy  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError:
        pass


# how the last ``connect`` of this process reached the cluster; "outlives": the GCS address of the
# cluster it last connected to without starting it; "started": of the one it started
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


def started_here() -> bool:
    """Whether this process started the connected cluster (it ends with this process): ``connect``
    started it, or, connected before, this process's ``ray.init`` did (a node of it is this process's
    child: ``host.started_by``)."""
    gcs = _gcs_address()
    if gcs is None or _HOW.get("outlives") == gcs:
        return False
    return _HOW.get("started") == gcs or host.started_by(os.getpid(), gcs)


def cli_address() -> Optional[str]:
    """The connected cluster's GCS address (``HOST:PORT``) where a Ray command line on this host (``ray
    list actors``, ``ray status``) needs it to reach that cluster: as RAY_ADDRESS, which those commands take
    before their own ``--address``; None where their own search finds it (``cli_cluster``) and under Ray
    Client."""
    gcs = _gcs_address()
    if gcs is None:
        return None
    return None if cli_cluster() == _canonical(gcs) else gcs


def cli_cluster() -> Optional[str]:
    """The cluster a Ray command line on this host reaches when given no address, as Ray's own search
    finds it: RAY_ADDRESS, else the address file of Ray's default temp dir (the last ``ray start
    --head``: ``address_files``' first), else the one cluster with a node on this host
    (``host.gcs_addresses``); ``HOST:PORT`` with a local host written as this node's IP. None where it
    finds none, several, or an address that is not ``HOST:PORT`` (``ray://``, a dashboard's URL)."""
    found = os.environ.get("RAY_ADDRESS") or None
    if found in (None, "auto"):
        try:
            found = address_files()[0].read_text().strip() or None
        except OSError:
            found = None
    if found is None:
        running = host.gcs_addresses()
        found = next(iter(running)) if len(running) == 1 else None
    return _canonical(found) if found else None


def _canonical(address: str) -> Optional[str]:
    """``address`` (``HOST:PORT``) with a local host (localhost, 127.0.0.1, ::1) written as this node's IP,
    as Ray writes the addresses it finds; None for one of another form."""
    host_, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    if host_.strip("[]") in ("localhost", "127.0.0.1", "::1"):
        host_ = ray.util.get_node_ip_address()
    return f"{host_}:{port}"


_DASHBOARD: dict[str, Optional[str]] = {}   # GCS address -> the cluster's dashboard (``use_dashboard``)


def use_dashboard(url: Optional[str]) -> None:
    """Record ``url`` (``host:port`` or ``http://host:port``; "": none runs; None: Ray could not start it,
    as ``ray.init`` returns it then, where one that runs none by choice returns "") as the connected
    cluster's Ray dashboard: the one ``ray.init`` returned to the process that connected (``connect``), and
    that process passes on to its workers that print it (a Tune trial's run: ``tune.trial.Trial``)."""
    gcs = _gcs_address()
    if gcs is not None:
        _DASHBOARD[gcs] = url


def dashboard_url() -> Optional[str]:
    """The connected cluster's Ray dashboard (``http://host:port``), None when it runs none, under Ray
    Client, and in an actor not told it (``use_dashboard``): as ``ray.init`` returned it to the process
    that connected (``connect``; a driver connected by its own ``ray.init`` asks Ray for that context
    again). An actor's own context holds the dashboard address its node's raylet was given, the default
    port even where the dashboard took another because that one was in use: another Ray's dashboard, so
    an actor names none it was not told."""
    return (url if "://" in url else f"http://{url}") if (url := _told_dashboard()) else None


def dashboard_failed() -> bool:
    """Whether Ray could not start the connected cluster's dashboard (``ray.init`` returned None, logged why);
    False where none runs by choice (include_dashboard off, no dashboard packages: ""), under Ray Client."""
    return _told_dashboard() is None


def _told_dashboard() -> Optional[str]:
    from ray.util.client import ray as client

    if not ray.is_initialized() or client.is_connected():
        return ""
    gcs = _gcs_address()
    if gcs not in _DASHBOARD and ray.get_runtime_context().get_actor_id() is None:
        # (configure_logging=False: a second ray.init would set Ray's logging again)
        use_dashboard(ray.init(ignore_reinit_error=True, configure_logging=False).dashboard_url)
    return _DASHBOARD.get(gcs or "", "")


def cluster_origin() -> str:
    """How this process reached the connected cluster and what it has, for the console: ``attached to the
    cluster at HOST:PORT`` and how it was found (``--address``, RAY_ADDRESS, Ray's address file), or
    ``started a local cluster at HOST:PORT`` (it ends with this process), where none was found (and the
    other Ray clusters running on this host, which ``--address`` joins); then its CPUs and GPUs. Told by
    whether this process started the cluster (``started_here``)."""
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - Ray Client has no GCS client in the driver
        address = os.environ.get("RAY_ADDRESS") or "a Ray Client server"
    has = cluster_size()
    if started_here():
        if _HOW.get("last") == "reused":
            return (f"reusing the local cluster this process started at {address} ({has}; it stops when this "
                    "process ends)")
        looked = _HOW.get("stale") or ("no --address or RAY_ADDRESS, no Ray address file in "
                                       + ", ".join(str(f.parent) for f in address_files()))
        others = other_clusters()
        elsewhere = (f"; Ray also runs on this host at {', '.join(others)}: --address joins it, or "
                     "RAY_TMPDIR naming its --temp-dir" if others else "")
        return (f"started a local cluster at {address} ({has}; it stops when this process ends; "
                f"{looked}{elsewhere})")
    how = f", named by {_HOW['source']}" if _HOW.get("source") else ""
    return f"attached to the cluster at {address} ({has}{how})"


def cluster_size() -> str:
    """The connected cluster's logical CPUs and GPUs, e.g. ``4 CPUs, 0 GPUs``."""
    res = ray.cluster_resources()
    return f"{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs"


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
        raise ConfigError(NO_GPUS)
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
    sees every GPU of its node (its environment has ``ALL_GPUS_VISIBLE_ENV``: ``acquire.actors_env``), else
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


"""The only place that talks to Ray: connect, place and start the actors, call them, tear down.

Bootstrap follows Ray Train's: one placement-group bundle per actor (PACK, so that neighbouring ranks
share a node), actors ordered by (node, bundle) so that ranks of one node are contiguous and the
filter-split groups (innermost mesh axis) stay inside a node; rank 0 picks the rendezvous address and
every actor joins the torch.distributed process group at once.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayconv.config import Config, ConfigError, batch_split_problem
from rayconv.mesh import Mesh
from rayconv.actor.worker import Worker, exception_summary, visible_index
from rayconv.errors import CallTimeout, ClusterError

NAMESPACE = "rayconv"
# Actors and tasks with this see every GPU of their node (and select theirs by ``visible_index``).
ALL_GPUS_VISIBLE_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
LOST_GRACE_S = 2.0  # after an actor error, how long to look for a lost actor that caused it


def _is_lost(e: BaseException) -> bool:
    """An actor that is gone (process killed, node lost), rather than one that raised."""
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                          ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError))


def _is_collective_failure(e: BaseException) -> bool:
    """A torch.distributed failure inside the actor: a peer vanished, a collective timed out."""
    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
    import torch.distributed as dist

    if isinstance(cause, getattr(dist, "DistError", ())):
        return True
    text = str(cause)
    return any(w in text for w in ("gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset"))


def connect(address: Optional[str], quiet: bool = True, min_cpus: Optional[int] = None) -> None:
    """Connect to the cluster at ``address``, else to RAY_ADDRESS or a running local cluster
    (``ray start --head``), else start a local one (dashboard on 127.0.0.1). A local one started
    here gets at least ``min_cpus`` logical CPUs, so that a layout with more CPU actors than cores
    (``--dp 2 --fs 2`` on a 2-core laptop) still runs, oversubscribed. Raises ConfigError for an address
    where no Ray cluster answers, ClusterError when Ray cannot connect."""
    _probe(address or os.environ.get("RAY_ADDRESS"))
    if ray.is_initialized():
        return
    kw = dict(address=address, namespace=NAMESPACE, log_to_driver=not quiet, configure_logging=True,
              logging_level="WARNING")
    extra = {"num_cpus": min_cpus} if min_cpus and min_cpus > (os.cpu_count() or 1) else {}
    try:
        try:
            ray.init(**kw, **extra)
        except ValueError as e:
            if not extra or "num_cpus" not in str(e):
                raise
            ray.init(**kw)  # an existing cluster was found: its resources are what they are
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        where = address or os.environ.get("RAY_ADDRESS") or "a local cluster"
        raise ClusterError(f"cannot connect to Ray at {where} ({e}): check --address / RAY_ADDRESS, "
                           "or run `ray start --head` first") from None


def _probe(address: Optional[str], timeout_s: float = 5.0) -> None:
    """Fail fast, in one line, on a ``host:port`` cluster address where no Ray GCS answers: nobody
    listening (Ray itself retries for minutes), or something other than Ray (Ray's GCS client then
    logs its RPC errors for as long). The GCS is a gRPC server, so it must complete gRPC's HTTP/2
    handshake (``grpc.channel_ready_future``) within ``timeout_s`` seconds. Raises ConfigError: the
    address is the user's to change."""
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
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ConfigError(f"something answers at {address} but not a Ray cluster (no gRPC handshake within "
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


def resolve_layout(cfg: Config, log=print) -> Mesh:
    """Fill in ``cfg.device`` and ``cfg.dp`` from the cluster and check the mesh fits. Raises ConfigError.

    On a cluster given by --address or RAY_ADDRESS (one that can grow: autoscaler, nodes joining),
    a layout larger than the cluster waits up to --max-wait seconds for the devices, saying so; a
    local cluster cannot grow, so there the error is immediate."""
    kind, slots = available_devices(cfg.device)
    cfg.device = kind
    per_actor = 1 if kind == "cuda" else cfg.num_cpus_per_actor
    unit = "GPUs" if kind == "cuda" else f"CPU slots ({per_actor} CPU each)"
    if cfg.dp is None:
        cfg.dp = max(1, slots // per_actor // (cfg.pp * cfg.fs))
    mesh = Mesh(cfg.dp, cfg.pp, cfg.fs)
    can_grow = bool(cfg.address or os.environ.get("RAY_ADDRESS"))
    deadline = time.monotonic() + cfg.max_wait
    if mesh.world_size > slots // per_actor and can_grow:
        log(f"rayconv: layout {mesh.describe()} needs {mesh.world_size} {unit}, the cluster has "
            f"{slots // per_actor}: waiting up to {cfg.max_wait:.0f} s (--max-wait) for more")
    while mesh.world_size > slots // per_actor and can_grow and time.monotonic() < deadline:
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        slots = available_devices(cfg.device)[1]
    devices = slots // per_actor
    if mesh.world_size > devices:
        waited = f" after waiting {cfg.max_wait:.0f} s" if can_grow else ""
        raise ConfigError(f"layout {mesh.describe()} needs {mesh.world_size} {unit} but the cluster has "
                          f"{devices}{waited}: lower --dp/--pp/--fs, or add nodes")
    if cfg.sync_batchnorm and kind != "cuda":
        raise ConfigError("--sync-batchnorm needs GPUs (torch's SyncBatchNorm runs on CUDA only): "
                          "drop it on CPU (batch norm then uses per-replica statistics, as DDP)")
    if cfg.cuda_graphs == "on" and kind != "cuda":
        raise ConfigError("--cuda-graphs on needs GPUs (CUDA graphs): drop it on CPU")
    problem = batch_split_problem(cfg.global_batch_size, cfg.dp, cfg.num_microbatches)
    if problem:
        raise ConfigError(problem)
    return mesh


@dataclass
class Pending:
    """A call started on some actors: method name, ranks and their result references."""

    method: str
    ranks: list[int]
    refs: list[Any]


@dataclass
class Gang:
    """The started actors of one run, index = rank."""

    actors: list[Any]
    roles: list[str]
    pg: Any
    info: list[dict[str, Any]]

    def call(self, method: str, *args, ranks: Optional[Sequence[int]] = None, timeout_s: Optional[float] = None):
        """Call ``method(*args)`` on the actors (all, or ``ranks``); results in rank order (see ``call_each``)."""
        ranks = list(range(len(self.actors))) if ranks is None else list(ranks)
        return self.call_each(method, [args] * len(ranks), ranks=ranks, timeout_s=timeout_s)

    def call_each(self, method: str, args: Sequence[Sequence[Any]], ranks: Optional[Sequence[int]] = None,
                  timeout_s: Optional[float] = None) -> list[Any]:
        """Call ``method(*args[i])`` on actor ``ranks[i]`` (default: all, in rank order); return the results.

        If any actor raises, the others may be blocked in a collective: all actors are killed and a
        ClusterError names the failing actor's role and its error (no hang). Same after ``timeout_s``."""
        return self.collect(self.submit_each(method, args, ranks), timeout_s=timeout_s)

    def submit(self, method: str, *args) -> "Pending":
        """Start ``method(*args)`` on every actor without waiting; ``collect`` gets the results.
        Calls to one actor run in submission order, so the next step can be queued while one runs."""
        return self.submit_each(method, [args] * len(self.actors))

    def submit_each(self, method: str, args: Sequence[Sequence[Any]], ranks: Optional[Sequence[int]] = None) -> "Pending":
        ranks = list(range(len(self.actors))) if ranks is None else list(ranks)
        return Pending(method, ranks, [getattr(self.actors[r], method).remote(*a) for r, a in zip(ranks, args)])

    def collect(self, call: "Pending", timeout_s: Optional[float] = None) -> list[Any]:
        """Results of a submitted call in rank order; on failure as ``call_each`` says."""
        method, ranks, refs = call.method, call.ranks, call.refs
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                self.kill()
                raise CallTimeout(f"{method} did not finish within {timeout_s:g} s (a stuck actor or "
                                  "collective): actors stopped", recoverable=True)
            try:
                ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - re-raised with the actor's role
                r, err = ranks[refs.index(done[0])], e
                if not _is_lost(e):
                    # A peer that died makes the others' collectives fail first: look briefly for a
                    # lost actor, whose loss is the cause worth reporting.
                    late, _ = ray.wait(pending, num_returns=len(pending), timeout=LOST_GRACE_S)
                    for ref in late:
                        try:
                            ray.get(ref)
                        except Exception as e2:  # noqa: BLE001
                            if _is_lost(e2):
                                r, err = ranks[refs.index(ref)], e2
                                break
                self.kill()
                lost = _is_lost(err)
                what = "was lost (process or node died)" if lost else "failed"
                summary = exception_summary(err)
                if lost:  # Ray's explanation runs over several lines; its first says it all
                    summary = summary.splitlines()[0]
                elif _is_collective_failure(err) and "timed out" in summary.lower():
                    summary += ("; the collective waited past --collective-timeout-s: raise it if a peer is "
                                "only slow, not stuck")
                raise ClusterError(f"actor {self.roles[r]} (rank {r}) {what} in {method}: {summary}",
                                   recoverable=lost or _is_collective_failure(err)) from None
        return ray.get(refs)

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


def _on_device(fn, gpu: bool, *args) -> Any:
    """Body of ``run_on_device``'s task: select the GPU Ray assigned (all GPUs visible), run ``fn``."""
    if gpu:
        import torch

        torch.cuda.set_device(visible_index(ray.get_gpu_ids()[0]))
    return fn(*args)


def run_on_device(fn, args: Sequence[Any], gpu: bool, timeout_s: float = 300.0) -> Any:
    """``fn(*args)`` as a Ray task on one GPU (``gpu``) or one CPU of the cluster; its result.
    With all GPUs of the node visible, the task uses the one Ray assigned. Raises ClusterError naming
    the task's error or the timeout."""
    env = ALL_GPUS_VISIBLE_ENV if gpu else {}
    # max_calls=1: the worker process exits afterwards, releasing its CUDA context and cached memory.
    ref = ray.remote(max_calls=1)(_on_device).options(
        num_gpus=1 if gpu else 0, num_cpus=1, max_retries=0,
        runtime_env={"env_vars": env} if env else None).remote(fn, gpu, *args)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise ClusterError(f"{fn.__name__} did not finish within {timeout_s:g} s on the cluster") from None
    except ray.exceptions.RayError as e:
        raise ClusterError(f"{fn.__name__} failed: {exception_summary(e)}") from None


def start_workers(cfg: Config, mesh: Mesh, run_name: str, timeout_s: float = 120.0) -> Gang:
    """Reserve one bundle per actor, start the actors, named ``rayconv/<run>/<role>`` in rank order.

    ``timeout_s`` (``--max-wait``) bounds the whole start-up: reserving the bundles (waiting for free
    resources) and the actors' processes starting and importing torch. Raises ClusterError saying
    which of the two ran out and that --max-wait raises it, or naming a Ray error at start (one line)."""
    deadline = time.monotonic() + timeout_s
    pg = reserve(cfg, mesh, run_name, timeout_s)
    return start_actors(cfg, mesh, run_name, pg, max(0.0, deadline - time.monotonic()), limit_s=timeout_s)


def _bundle(cfg: Config) -> dict[str, int]:
    return {"CPU": 1, "GPU": 1} if cfg.device == "cuda" else {"CPU": cfg.num_cpus_per_actor}


def reserve(cfg: Config, mesh: Mesh, run_name: str, timeout_s: float) -> Any:
    """The run's placement group ``rayconv/<run>``, one bundle per actor (PACK), ready within ``timeout_s``
    seconds. Raises ClusterError (nothing stays reserved)."""
    bundle = _bundle(cfg)
    try:
        pg = placement_group([dict(bundle) for _ in range(mesh.world_size)], strategy="PACK",
                             name=f"rayconv/{run_name}")
    except ray.exceptions.RayError as e:
        raise ClusterError(f"Ray refused the placement group of run {run_name}: {_first_line(e)}") from None
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except BaseException as e:
        Gang([], [], pg, []).kill()  # removes the placement group
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise ClusterError(f"could not reserve {mesh.world_size} x {bundle} within {timeout_s:g} s (--max-wait): "
                               "the cluster is busy or too small; free resources, lower the layout or raise "
                               "--max-wait") from None
        if isinstance(e, ray.exceptions.RayError):
            raise ClusterError(f"Ray could not reserve resources for run {run_name}: {_first_line(e)}") from None
        raise
    return pg


def start_actors(cfg: Config, mesh: Mesh, run_name: str, pg: Any, timeout_s: float,
                 limit_s: Optional[float] = None) -> Gang:
    """Start one actor per bundle of ``pg`` and wait up to ``timeout_s`` seconds for them to run (part
    of the start-up limit ``limit_s``, named in the error). Raises ClusterError; on failure the actors
    and ``pg`` are removed."""
    gpu, bundle = cfg.device == "cuda", _bundle(cfg)
    deadline = time.monotonic() + timeout_s
    actors: list[Any] = []
    roles: list[str] = []
    try:
        # Rank order: by node (in order of first appearance), then bundle index.
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        node_order: dict[str, int] = {}
        for b in range(mesh.world_size):
            node_order.setdefault(nodes[b], len(node_order))
        bundles = sorted(range(mesh.world_size), key=lambda b: (node_order[nodes[b]], b))
        env = ALL_GPUS_VISIBLE_ENV if (gpu and cfg.all_gpus_visible) else {}
        remote = ray.remote(Worker)
        _wait_names_free([f"rayconv/{run_name}/{mesh.role(r)}" for r in range(mesh.world_size)],
                         max(0.0, deadline - time.monotonic()))
        for rank, b in enumerate(bundles):
            role = mesh.role(rank)
            actors.append(remote.options(
                name=f"rayconv/{run_name}/{role}", namespace=NAMESPACE, num_cpus=bundle["CPU"],
                num_gpus=1 if gpu else 0, max_restarts=0, runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            ).remote(cfg.to_dict(), run_name, role))
            roles.append(role)
    except BaseException as e:
        # Nothing stays reserved when the start fails (a busy cluster, a name in use, Ctrl-C).
        Gang(actors, roles, pg, []).kill()
        if isinstance(e, ray.exceptions.RayError):
            raise ClusterError(f"Ray could not start the actors of run {run_name}: {_first_line(e)}") from None
        raise
    gang = Gang(actors, roles, pg, [])
    try:
        gang.info = gang.call("whereami", timeout_s=max(0.0, deadline - time.monotonic()))
    except CallTimeout:
        raise ClusterError(f"the {mesh.world_size} actors did not start within {limit_s or timeout_s:g} s (--max-wait; "
                           "their processes start and import torch, slowly on a loaded machine): raise --max-wait") from None
    return gang


def _first_line(e: BaseException) -> str:
    """The first line of a Ray error, without Ray's ``System error:`` prefix."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[0].removeprefix("System error: ")


def _wait_names_free(names: list[str], timeout_s: float) -> None:
    """Wait until no live actor holds one of ``names`` (actors of a previous attempt of this run that
    were just killed release their names asynchronously)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"an actor named {name} is still alive after {timeout_s:g} s (--max-wait): "
                                   "the actors of a previous attempt of this run did not stop in time")
            time.sleep(0.2)


class _Probe:
    """A bare process on one device of a placement group, for short measurements (``run_on_devices``)."""

    def __init__(self, gpu: bool):
        if gpu:
            import torch

            torch.cuda.set_device(visible_index(ray.get_gpu_ids()[0]))

    def free_address(self) -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def run(self, fn, *args) -> Any:
        return fn(*args)


def run_on_devices(fn, world: int, gpu: bool, args: Sequence[Any] = (), timeout_s: float = 300.0) -> list[Any]:
    """``fn(rank, world, master, *args)`` at once in ``world`` actors, one per GPU (``gpu``) or CPU, packed
    in one placement group as the training actors are (``master``: a free host:port on rank 0's node for
    a process-group rendezvous); their results in rank order. Raises ClusterError naming the error or
    the timeout; the actors and the reservation are released in every case."""
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    actors: list[Any] = []
    try:
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"could not reserve {world} x {bundle} within {timeout_s:.0f} s for "
                               f"{fn.__name__}: free resources") from None
        env = ALL_GPUS_VISIBLE_ENV if gpu else {}
        remote = ray.remote(_Probe)
        actors = [remote.options(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0,
                                 runtime_env={"env_vars": env} if env else None,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                                 ).remote(gpu) for r in range(world)]
        master = ray.get(actors[0].free_address.remote(), timeout=timeout_s)
        return ray.get([a.run.remote(fn, r, world, master, *args) for r, a in enumerate(actors)], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(f"{fn.__name__} did not finish within {timeout_s:g} s on the cluster") from None
    except ray.exceptions.RayError as e:
        raise ClusterError(f"{fn.__name__} failed: {exception_summary(e)}") from None
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)

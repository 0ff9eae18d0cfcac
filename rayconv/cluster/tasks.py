"""Short jobs on the cluster's devices, outside any run's actors: the planner's and the pipeline
balancer's measurements.

``run_on_device`` runs a function as a Ray task on one GPU or CPU (with a user's model's runtime
environment, ``user_model.actor_runtime_env``, as the run's actors get it, so that the task can build
the model); ``run_on_devices`` runs one in
``world`` ``Probe`` actors at once, packed in one placement group as the training actors are, so that
a process-group rendezvous between them measures the links a run would use.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayconv.cluster import across, pool
from rayconv.cluster.connect import ALL_GPUS_VISIBLE_ENV, exception_summary, visible_index
from rayconv.cluster.ship import modules, unpack, with_modules
from rayconv.errors import ClusterError
from rayconv.user_model import actor_runtime_env


def _on_device(fn, gpu: bool, shipped: Optional[bytes], *args) -> Any:
    """Body of ``run_on_device``'s task: a user's modules unpacked (``shipped``: ``ship.unpack``), the
    GPU Ray assigned selected (all GPUs visible), ``fn`` run."""
    unpack(shipped)
    if gpu:
        import torch

        torch.cuda.set_device(visible_index(ray.get_gpu_ids()[0]))
    return fn(*args)


def gpu_free_bytes() -> int:
    """Free memory in bytes of this task's GPU (``run_on_device(gpu_free_bytes, (), gpu=True)``)."""
    import torch

    return int(torch.cuda.mem_get_info()[0])


def gpu_total_bytes() -> int:
    """Total memory in bytes of this task's GPU."""
    import torch

    return int(torch.cuda.mem_get_info()[1])


def run_on_device(fn, args: Sequence[Any], gpu: bool, timeout_s: float = 300.0, model: Optional[str] = None,
                  num_gpus: float = 1.0) -> Any:
    """``fn(*args)`` as a Ray task on one GPU (``gpu``; ``num_gpus`` of it reserved, the run's
    --gpus-per-actor, so that the task fits a bundle of a Tune trial's group) or one CPU of the cluster;
    its result.
    With all GPUs of the node visible, the task uses the one Ray assigned. ``model`` (a ``--model``
    name) gives the task the runtime environment a run's actors get for it: a user's modules shipped
    (``cluster.ship``), a pickled callable. Raises ClusterError naming the task's error, the timeout,
    or a failed shipping."""
    pool.release()   # (actors kept for reuse would hold the device or CPU the task needs)
    across.make_room_for({"GPU": num_gpus if gpu else 0.0, "CPU": 1.0})   # (... or kept for another command)
    env = with_modules(actor_runtime_env(model or "", ALL_GPUS_VISIBLE_ENV if gpu else {}))
    # max_calls=1: the worker process exits afterwards, releasing its CUDA context and cached memory.
    ref = ray.remote(max_calls=1)(_on_device).options(
        num_gpus=num_gpus if gpu else 0, num_cpus=1, max_retries=0,
        runtime_env=env).remote(fn, gpu, modules(env), *args)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise ClusterError(f"{fn.__name__} did not finish within {timeout_s:g} s on the cluster") from None
    except ray.exceptions.RayError as e:
        raise ClusterError(f"{fn.__name__} failed: {exception_summary(e)}") from None


class Probe:
    """A bare process on one device of a placement group, for short measurements (``run_on_devices``)."""

    def __init__(self, gpu: bool):
        if gpu:
            import torch

            torch.cuda.set_device(visible_index(ray.get_gpu_ids()[0]))

    def open_rendezvous(self, timeout_s: float) -> str:
        from rayconv.parallel import comm

        return comm.open_rendezvous(ray.util.get_node_ip_address(), timeout_s)

    def run(self, fn, *args) -> Any:
        return fn(*args)


def run_on_devices(fn, world: int, gpu: bool, args: Sequence[Any] = (),
                   timeout_s: float = 300.0) -> list[Any]:
    """``fn(rank, world, master, *args)`` at once in ``world`` actors, one per GPU (``gpu``) or CPU, packed
    in one placement group as the training actors are (``master``: the host:port on rank 0's node of
    a process-group rendezvous opened there by ``comm.open_rendezvous``, which ``fn`` joins with
    ``comm.join_world``); their results in rank order. Raises ClusterError naming the error or the
    timeout; the actors and the reservation are released in every case."""
    pool.release()   # (actors kept for reuse would hold what these need)
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    actors: list[Any] = []
    try:
        try:
            ready = pg.ready()
            # (actors kept for another command would hold what these need)
            across.make_room(ready, timeout_s)
            ray.get(ready, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"could not reserve {world} x {bundle} within {timeout_s:.0f} s for "
                               f"{fn.__name__}: free resources") from None
        env = ALL_GPUS_VISIBLE_ENV if gpu else {}
        remote = ray.remote(Probe)
        actors = [
            remote.options(
                num_cpus=1,
                num_gpus=1 if gpu else 0,
                max_restarts=0,
                runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
            ).remote(gpu)
            for r in range(world)
        ]
        master = ray.get(actors[0].open_rendezvous.remote(timeout_s), timeout=timeout_s)
        return ray.get([a.run.remote(fn, r, world, master, *args) for r, a in enumerate(actors)],
                       timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(f"{fn.__name__} did not finish within {timeout_s:g} s on the cluster") from None
    except ray.exceptions.RayError as e:
        raise ClusterError(f"{fn.__name__} failed: {exception_summary(e)}") from None
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)

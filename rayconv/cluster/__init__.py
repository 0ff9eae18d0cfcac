"""Ray plumbing, below the parallel code: connecting to a cluster (``connect``), a run's actors got and
given back through one seam (``acquire``: started early, kept, or new; ``pool`` and ``across`` keep
them), the actors of one run and their placement group (``group``: handed the actor class, it imports
none), short jobs on the
cluster's devices (``tasks``); free slots and draining nodes (``nodes``); one call to the actors
(``calls``); a command's actors kept on the cluster for the next command (``across``), each
watching itself there (``watch``, imported by the actor). The face re-exports no name of a submodule
(``connect`` stays the module, so ``rayconv.cluster.connect.connect`` is the function).

The driver, the planner and the bench reach Ray only through here. Elsewhere Ray is asked only what a
process learns of itself or hands to Ray directly: an actor's node, IP and GPU ids
(``actor/actor.py``, ``actor/build.py``), Ray's metric gauges (``outputs/metrics.py``), and
``prepare.py``'s shard-writing tasks."""

from rayconv.cluster.connect import available_devices, exception_summary, probe, visible_index
from rayconv.cluster.acquire import ActorSpec, acquire, release
from rayconv.cluster.group import ActorGroup, Pending, reserve, create_actors
from rayconv.cluster.tasks import run_on_device, run_on_devices

__all__ = ["available_devices", "exception_summary", "probe", "visible_index", "ActorSpec", "acquire",
           "release", "ActorGroup", "Pending", "reserve", "create_actors", "run_on_device", "run_on_devices"]

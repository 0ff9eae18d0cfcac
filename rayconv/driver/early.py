"""The actors started while the driver still checks: their processes start, import torch and (on GPUs)
make their CUDA context while the driver reads the data's metadata, checks the model on the meta
device and plans (``resolve.resolve_on_cluster`` calls ``start_early`` once the layout is known).

They start early only when nothing the driver does after them needs a device of the cluster: the
tasks that measure a GPU (``--gpus-per-actor`` below 1, ``--data-on-device auto`` for folders of images
or shards) or balance pipeline stages by measured time would wait for the devices the actors hold;
and only when the cluster has the bundles free at once (a busy cluster's wait comes after the checks,
as it did). Otherwise, and on any error while starting them early, the actors start after the checks
(``cluster.acquire.acquire``), where that error is met again and reported. A check that refuses the
run after they started (``REFUSALS``: a setting, the data, the model's layout, the output folder) leaves
them unused and healthy: they are kept for the next run of this process, as a finished run's are
(``--keep-actors-s``), so that the corrected run starts on them; any other failure stops them and
removes their placement group: nothing is left (``cluster.acquire.release_started``).
"""

from __future__ import annotations

from typing import Optional

from rayconv.actor.actor import Actor
from rayconv.cluster.acquire import ActorSpec, acquire
from rayconv.cluster.group import ActorGroup
from rayconv.config import Config
from rayconv.errors import ConfigError, DataError, LayoutError, ScheduleError
from rayconv.mesh import Mesh

# A run refused by its checks (the user changes a setting, the data or the output folder and runs again)
REFUSALS = (ConfigError, DataError, LayoutError, ScheduleError, FileExistsError)


def needs_devices(cfg: Config) -> bool:
    """Whether the driver's work after the layout is known runs tasks on the cluster's devices (see the
    module docstring); ``--device auto`` counts as cuda."""
    gpu = cfg.device != "cpu"
    measures_gpu = gpu and (cfg.gpus_per_actor < 1 or (cfg.data in ("imagefolder", "shards")
                                                        and cfg.data_on_device == "auto"))
    by_time = cfg.balance == "time" or (cfg.balance == "auto" and gpu)
    return measures_gpu or (cfg.pp > 1 and not cfg.stages and by_time)


def start_early(cfg: Config, mesh: Mesh, run_name: str) -> Optional[ActorGroup]:
    """Start the actors of ``cfg`` (device and ``dp`` resolved) on ``mesh`` for the run ``run_name``
    without waiting for them, when the module docstring's conditions hold (``acquire(spec, early=True)``;
    the run's ``acquire`` takes them). Returns the actors started (or kept by a previous run and
    renewed; those started already for ``run_name``), None when none were."""
    if needs_devices(cfg):
        return None
    return acquire(ActorSpec(Actor, cfg, mesh, run_name), early=True)

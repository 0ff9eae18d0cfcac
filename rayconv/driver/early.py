"""The actors started while the driver still checks: their processes start, import torch and (on GPUs)
make their CUDA context while the driver reads the data's metadata, checks the model on the meta
device and plans (``resolve.resolve_on_cluster`` calls ``EarlyActors.start`` once the layout is known).

They start early only when nothing the driver does after them needs a device of the cluster: the
tasks that measure a GPU (``--gpus-per-actor`` below 1, ``--data-on-device auto`` for folders of images
or shards) or balance pipeline stages by measured time would wait for the devices the actors hold;
and only when the cluster has the bundles free at once (a busy cluster's wait comes after the checks,
as it did). Otherwise, and on any error while starting them early, the actors start after the checks
(``cluster.group.start_group``), where that error is met again and reported. A check that refuses the
run after they started (``REFUSALS``: a setting, the data, the model's layout, the output folder) leaves
them unused and healthy: they are kept for the next run of this process, as a finished run's are
(``cluster.pool``, ``--keep-actors-s``), so that the corrected run starts on them; any other failure
stops them and removes their placement group (``kill``): nothing is left.
"""

from __future__ import annotations

import time
from typing import Optional

from rayconv.actor.actor import Actor
from rayconv.cluster import across, pool
from rayconv.cluster.group import (ActorGroup, actors_env, create_actors, given_group, in_given_group,
                                   reserve, reuse_kept)
from rayconv.config import Config
from rayconv.errors import ClusterError, ConfigError, DataError, LayoutError, ScheduleError
from rayconv.mesh import Mesh

RESERVE_S = 2.0  # how long the early start waits for free bundles before leaving the start for later
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


class EarlyActors:
    """The run's actors, started before its checks end (``start``), until the run takes them (``take``)
    or a failure stops them (``kill``)."""

    def __init__(self) -> None:
        self.group: Optional[ActorGroup] = None
        self.mesh: Optional[Mesh] = None
        self.run_name: Optional[str] = None   # the name they started under

    def start(self, cfg: Config, mesh: Mesh, run_name: str) -> Optional[ActorGroup]:
        """Start the actors of ``cfg`` (device and ``dp`` resolved) on ``mesh`` without waiting for them,
        when the module docstring's conditions hold; else, or when they were started already
        (``driver.prestart``: ``take`` checks the mesh), nothing. Returns the actors started (or kept
        by a previous run and renewed), None when none were."""
        if needs_devices(cfg) or self.group is not None:
            return self.group
        t0 = time.monotonic()
        try:
            given = given_group(cfg, mesh)
            env = actors_env(cfg, mesh)
            if given is not None:   # a Tune trial's group: its bundles are this run's
                self.group = in_given_group(Actor, cfg, mesh, run_name, given, cfg.max_wait, False, env)
            else:
                # a previous run's (--keep-actors-s)
                self.group = reuse_kept(Actor, cfg, mesh, run_name, env)
                if self.group is None:
                    pg = reserve(cfg, mesh, run_name, min(cfg.max_wait, RESERVE_S))
                    self.group = create_actors(Actor, cfg, mesh, run_name, pg,
                                               max(0.0, cfg.max_wait - (time.monotonic() - t0)),
                                               limit_s=cfg.max_wait, wait=False, env=env)
            self.mesh, self.run_name = mesh, run_name
        except (ClusterError, ConfigError, DataError):
            self.group = None   # (nothing stays reserved: reserve and create_actors remove what they made)
        return self.group

    def take(self, mesh: Mesh) -> Optional[ActorGroup]:
        """The actors started early, if they fit ``mesh`` (the run's, as resolved); else None, and any
        started are stopped."""
        group, self.group = self.group, None
        if group is not None and mesh != self.mesh:
            group.kill()
            return None
        return group

    def keep(self, keep_s: float) -> None:
        """Keep the actors not taken for the next run of this process (``cluster.pool.keep``, ``keep_s``
        seconds), where the run was refused by its checks; not where they may outlive this process
        (``cluster.across``: a command ends at its error): there ``kill`` stops them."""
        if self.group is not None and not across.enabled() and pool.keep(self.group, self.group.key, keep_s):
            self.group = None

    def kill(self) -> None:
        """Stop the actors not taken and remove their placement group (safe to repeat)."""
        group, self.group = self.group, None
        if group is not None:
            group.kill()

"""The actors started while the driver still checks: their processes start, import torch and (on GPUs)
make their CUDA context while the driver imports torch (``start_first``) or reads the data's metadata,
checks the model on the meta device and plans (``resolve.resolve_on_cluster``, once the layout is known:
the controller's ``acquire(spec, early=True)``).

``start_first`` runs before the command and ``rayconv.fit`` import ``driver.job`` (``api.start_and_train``):
where the run's actors can start before the driver's checks (``can_start_first``: no ``--resume``, no user's
model or ``--init`` file, no ``--layout auto``, and ``needs_devices``'s conditions) and these settings passed
the model's checks on this machine before (``driver.passed``), it checks the model's name
(``model_names``), the output folder, connects Ray and resolves the device and ``dp``
(``driver.prestart``) and starts the actors (``cluster.acquire``), all without torch; only then does the
driver import torch and the training code (seconds) while the actors' processes start and import theirs.
``train_run`` then resolves the run as it would (``driver.resolve``), reusing the connection, the run
name and the actors. Where the actors cannot start first, ``train_run`` runs as it is.

They start early only when nothing the driver does after them needs a device of the cluster: the
tasks that measure a GPU (``--gpus-per-actor`` below 1, ``--data-on-device auto`` for folders of images
or shards) or balance pipeline stages by measured time would wait for the devices the actors hold;
and only when the cluster has the bundles free at once (a busy cluster's wait comes after the checks,
as it did). Otherwise, and on any error while starting them early, the actors start after the checks
(``cluster.acquire.acquire``), where that error is met again and reported. A check that refuses the
run after they started (``REFUSALS``: a setting, the data, the model's layout, the output folder) leaves
them unused and healthy: they are kept for the next run of this process, as a finished run's are
(``--keep-actors-s``), so that the corrected run starts on them; any other failure stops them and
removes their placement group: nothing is left (``cluster.acquire.release_started``). No torch here
(a test imports this module in a fresh process and checks).
"""

from __future__ import annotations

from typing import Optional

from rayconv.actor.actor import Actor
from rayconv.cluster.acquire import ActorSpec, acquire
from rayconv.cluster.capacity import resolve_layout
from rayconv.cluster.connect import connect_run
from rayconv.config import Config
from rayconv.driver.passed import passed
from rayconv.driver.prestart import open_output
from rayconv.errors import ConfigError, DataError, LayoutError, ScheduleError
from rayconv.model_names import check_known
from rayconv.user_model import is_user_model

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


def can_start_first(cfg: Config) -> bool:
    """Whether ``cfg``'s actors may start before the driver imports torch: nothing the driver checks
    before the layout needs torch (no ``--resume`` checkpoint, user's model, ``--init`` file or
    ``--layout auto`` plan) and nothing after it needs the cluster's devices (``needs_devices``)."""
    return not (
        cfg.resume or cfg.init or cfg.layout == "auto" or is_user_model(cfg.model) or needs_devices(cfg)
    )


def start_first(cfg: Config, log=print) -> Optional[str]:
    """The run's actors started before torch is imported, when ``can_start_first``: the model's name
    checked against this machine's listing of torchvision's models (``model_names.check_known``), the output
    folder (named: ``prestart.with_output_folder``) checked and the run's name made from it
    (``prestart.open_output``), Ray connected (``connect_run``: the start-up clock's ``ray``),
    the layout resolved, the actors started without waiting for them
    (``acquire(spec, early=True)``). Returns the run's name they started under; None where none started (not
    ``can_start_first``, or the layout does not fit: the run refuses it after its checks, as it would; or
    the cluster lacks the devices yet: the run waits for them as it would; also where the model's checks
    have not passed for these settings on this machine: ``driver.passed``, the run checks its model before
    Ray). Raises ConfigError / FileExistsError (the output folder), ClusterError (Ray)."""
    if not can_start_first(cfg) or not passed(cfg):
        return None
    # (a torchvision model's name, where this machine listed them: the actors check the rest)
    check_known(cfg.model)
    _, run_name = open_output(cfg)
    connect_run(cfg)
    try:
        resolved, mesh = resolve_layout(cfg, log, wait=False)
    except ConfigError:   # (too few devices yet, or a layout the run refuses once its checks say why)
        return None
    started = acquire(ActorSpec(Actor, resolved, mesh, run_name), early=True)
    return run_name if started is not None else None

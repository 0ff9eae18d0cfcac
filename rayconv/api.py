"""``rayconv.fit``: the Python form of ``python -m rayconv.run``.

    import rayconv
    summary = rayconv.fit(model="path/to/resnetish.py:ResNetish", data="digits", dp=2, steps=100)
    summary = rayconv.fit(rayconv.Config(model="resnet18", data="shards", data_dir="shards"), lr=0.1)

Settings have the flags' names (``global_batch_size`` is ``--global-batch-size``) and are checked as
the command line checks them, all before Ray starts: a bad one raises ConfigError (DataError,
LayoutError, CheckpointError) at once. ``model`` may also be a callable (a function or class returning an
``nn.Module``): one importable by its module and name runs as ``module:qualname``; any other (a lambda,
a local function) is pickled to the actors with Ray's serializer, and refused in one line when it
cannot be. A run that ended normally leaves its actors for --keep-actors-s seconds (default 60), so that
the next ``fit`` of this process that needs the same actors starts at once (``rayconv.cluster.acquire``);
``release_actors()`` stops them sooner. This module imports neither torch nor Ray until ``fit`` is called.
"""

from __future__ import annotations

from typing import Any, Optional

from rayconv.config import Config
from rayconv.errors import ConfigError
from rayconv.flags import from_mapping, resumed_settings
from rayconv.outputs.checkpoint import saved_config
from rayconv.startup import begin


def fit(config: Optional[Config] = None, /, *, log=print, on_eval=None, **settings: Any) -> dict[str, Any]:
    """Train as ``config`` (a Config, or None for the defaults) with ``settings`` over it, as
    ``python -m rayconv.run`` with those flags would, and return the run's summary (summary.json's
    content; its ``out`` says where the results are: a local folder in full, or the URI as given, e.g.
    ``out="s3://bucket/runs/r1"``). ``log`` receives the progress lines; ``on_eval(row, total_steps)``, if
    given, each evaluation's metrics row (raising ``rayconv.errors.RunStopped`` in it stops the run, its
    folder kept with status interrupted: how ``rayconv.tune`` stops a trial early). With ``resume=``, the
    checkpoint's settings come first, as on the command line. Raises ConfigError / DataError / LayoutError /
    CheckpointError / FileExistsError before Ray starts, ClusterError when the actors fail."""
    begin(None, "fit call")  # summary.json's startup: seconds since this call
    if config is not None and not isinstance(config, Config):
        raise ConfigError(f"rayconv.fit(config): a rayconv.Config or None, not {type(config).__name__} "
                          "(settings go as keywords: rayconv.fit(model='convnet', steps=10))")
    values = {**(config.to_dict() if config is not None else {}), **settings}
    if values.get("resume"):
        values = {**resumed_settings(saved_config(values["resume"])), **values}
    if "model" in values and not isinstance(values["model"], str):
        # (torch and Ray only once a callable is given: the model's name is made from it)
        from rayconv.user_model import model_name

        values["model"] = model_name(values["model"])
    cfg = from_mapping(values).validate()
    # The driver imports Ray, then torch (seconds), only once the settings are known to be good; the
    # actors start before torch where they can (driver.early).
    from rayconv.driver.prestart import with_output_folder

    return start_and_train(with_output_folder(cfg), log=log, on_eval=on_eval)


def start_and_train(cfg: Config, log=print, **kw: Any) -> dict[str, Any]:
    """``driver.job.train_run(cfg, log, **kw)`` with the actors started before the driver imports
    torch where they can (``driver.early.start_first``); ``cfg`` has its output folder named
    (``with_output_folder``: the actors' run name is made from it). Raises what ``train_run`` raises;
    actors started here and not taken by the run are stopped."""
    from rayconv.driver.early import start_first  # (Ray; not torch)

    run_name = start_first(cfg, log)   # (the run's name on the cluster, where its actors started)
    try:
        from rayconv.driver.job import train_run  # (torch and the training code: seconds)
    except BaseException:
        from rayconv.cluster.acquire import release_started

        release_started(run_name)
        raise
    return train_run(cfg, log=log, run_name=run_name, **kw)


def release_actors() -> None:
    """Stop the actors a finished ``fit`` of this process kept for the next (--keep-actors-s) and free
    their resources now (safe to repeat; nothing when none are kept)."""
    import sys

    seam = sys.modules.get("rayconv.cluster.acquire")   # (not imported: no run kept anything)
    if seam is not None:
        seam.release_kept()

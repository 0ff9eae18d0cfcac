"""``rayconv.tune``: hyperparameter search over rayconv runs with Ray Tune.

    from rayconv import tune
    found = tune.search({"lr": {"loguniform": [0.01, 1]}, "opt": {"choice": ["sgd", "sgd_nesterov"]}},
                        {"dp": 2, "epochs": 4}, num_samples=4, scheduler="asha", max_concurrent=2)
    found.best_folder     # the best trial's run folder

and ``python -m rayconv.tune --space SPACE [--num-samples N] [--scheduler asha|pbt|fifo] [--max-concurrent
C] [--metric M] [--resume SEARCH_DIR] [any rayconv.run flag: the base settings]``. Any run flag is a
search dimension (``space``: grid, choice, uniform, loguniform, randint), checked before any trial
starts. Each trial is a normal rayconv run in ``<search>/trial-<k>/`` with its own placement group and
actors (its layout's; a trial may be dp/pp/fs), each evaluation reported to Tune; ASHA ends trials
early at evaluations (their folders keep what they wrote, status interrupted). The trials are ranked
by ``val_accuracy`` when the runs hold out a validation split, else ``test_accuracy`` (``metric``).
PBT (``scheduler="pbt"``, with ``eval_every``: the trials checkpoint at each evaluation) has a trial of
the lowest quarter continue a top-quarter trial's checkpoint with perturbed settings (only
``space.PBT_MUTABLE``: lr, label smoothing, mixup/cutmix alpha, random erasing).
This module imports neither torch nor Ray until ``search`` is called.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def search(space: dict[str, Any], base_settings: Optional[dict[str, Any]] = None, *, num_samples: int = 1,
           scheduler: str = "asha", max_concurrent: Optional[int] = None, metric: Optional[str] = None,
           mode: Optional[str] = None, grace_period: int = 1, reduction_factor: int = 2,
           perturbation_interval: int = 2, synch: bool = False, resume: Optional[str] = None,
           callbacks: Sequence[Any] = (), log=print):
    """Search ``space`` (flag -> distribution, ``rayconv.tune.space``) over runs of ``base_settings``
    (run settings by their flags' names; ``out``: the search folder, default ``runs/search-<time>``).
    ``num_samples`` samples of the space (each grid crossed in full per sample); ``scheduler`` asha
    (``grace_period`` evaluations before the first cut, ``reduction_factor``), pbt (every
    ``perturbation_interval`` evaluations, ``synch``: all trials at once; needs ``eval_every``) or fifo; at
    most ``max_concurrent`` trials at once (default: as many as the cluster holds); ``metric`` / ``mode`` rank
    the trials. ``resume``: a search folder whose search was interrupted, continued with its own settings
    (Tune's ``Tuner.restore``). ``callbacks``: Tune callbacks. Returns a ``SearchResult`` (``rows``: one per
    trial; ``best``; ``best_folder``), also written as results.csv / results.json. Raises ConfigError (a bad
    space, an unknown flag, a trial that would be refused), FileExistsError, ClusterError; a trial that fails
    is a row of the results, the others go on."""
    from rayconv.tune.runner import search as run

    return run(space, base_settings, num_samples=num_samples, scheduler=scheduler,
               max_concurrent=max_concurrent, metric=metric, mode=mode, grace_period=grace_period,
               reduction_factor=reduction_factor, perturbation_interval=perturbation_interval, synch=synch,
               resume=resume, callbacks=callbacks, log=log)


__all__ = ["search"]

"""The search itself, over Ray Tune: checks, the Tuner (or its restore), the results table.

Each trial is ``trial.Trial`` with ``trial.trial_resources`` (its placement group: the layout's actor
bundles); ``--max-concurrent`` bounds the trials running at once, and Tune starts a trial only when
its whole group fits. The search folder holds ``search.json`` (what ``--resume`` needs), ``tune/``
(Tune's experiment state), ``trial-<k>/`` (each a normal run folder), ``logs/trial-<k>.log`` (each
run's console lines) and ``results.csv`` / ``results.json``. It may be a URI (``--out
s3://bucket/searches/s1``, ``storage.place``): Tune's state goes there through the same ``pyarrow.fs``
file system, each trial's run writes its folder there, each log is uploaded whole at each line.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from rayconv.errors import ConfigError
from rayconv.files import write_json
from rayconv.storage import Location, place
from rayconv.storage_checks import check_readable, check_writable
from rayconv.tune import results as table
from rayconv.tune.space import NOT_SEARCHED, PBT_MUTABLE, check_metric, check_space, default_metric, pbt_base

SCHEDULERS = ("asha", "fifo", "pbt")
MAX_T = 10**6  # ASHA's last rung: beyond any run's evaluations, so that trials end by their own length


@dataclass
class SearchResult:
    """What a search found: its folder, the metric, one row per trial, the best row (or None; None too
    for an interrupted search), whether it was interrupted."""

    search_dir: Path
    metric: str
    rows: list[dict[str, Any]]
    best: Optional[dict[str, Any]]
    interrupted: bool = False   # stopped (Ctrl-C) before every trial ended: --resume continues it

    @property
    def best_folder(self) -> Optional[str]:
        return self.best["folder"] if self.best else None


def check_options(base: dict[str, Any], space: dict[str, Any], num_samples: int, scheduler: str,
                  max_concurrent: Optional[int], metric: Optional[str],
                  mode: Optional[str]) -> tuple[str, str]:
    """The search's own options checked; returns (metric, mode). Raises ConfigError."""
    for key in NOT_SEARCHED:
        if key in ("out", "address"):
            continue
        if base.get(key) not in (None, False, "manual"):
            raise ConfigError(f"--{key.replace('_', '-')} is not for a search's trials: each trial is a new "
                              "run (resume a search with --resume SEARCH_DIR; give the layout with "
                              "--dp/--pp/--fs)")
    if num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1 (got {num_samples})")
    if max_concurrent is not None and max_concurrent < 1:
        raise ConfigError(f"--max-concurrent must be >= 1 (got {max_concurrent})")
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler {scheduler}: choose asha (early stop at evaluations), pbt "
                          "(population-based training: weak trials continue strong ones' checkpoints, "
                          "perturbed) or fifo (none)")
    metric = metric or default_metric(base, space)
    mode = mode or ("min" if metric.endswith(("loss", "error")) else "max")
    check_metric(metric, mode, base, space)
    return metric, mode


def new_search_dir() -> Path:
    return Path("runs") / f"search-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def search(space: dict[str, Any], base: Optional[dict[str, Any]] = None, *, num_samples: int = 1,
           scheduler: str = "asha", max_concurrent: Optional[int] = None, metric: Optional[str] = None,
           mode: Optional[str] = None, grace_period: int = 1, reduction_factor: int = 2,
           perturbation_interval: int = 2, synch: bool = False, resume: Optional[str] = None,
           callbacks: Sequence[Any] = (), log=print) -> SearchResult:
    """See ``rayconv.tune.search``."""
    if resume:
        search_dir = place(resume, flag="--resume")
        if isinstance(search_dir, Location):
            check_readable(search_dir, "--resume")
        saved = search_dir / "search.json"
        if not saved.is_file():
            raise ConfigError(
                f"--resume {resume}: no search.json there (not a search folder of rayconv.tune)")
        spec = json.loads(saved.read_text())
        space, base = spec["space"], spec["base"]
        num_samples, scheduler, max_concurrent = (spec["num_samples"], spec["scheduler"],
                                                  spec["max_concurrent"])
        metric, mode = spec["metric"], spec["mode"]
        grace_period, reduction_factor = spec["grace_period"], spec["reduction_factor"]
        perturbation_interval = spec.get("perturbation_interval", perturbation_interval)
        synch = spec.get("synch", synch)
        check_writable(search_dir, "--resume")   # (the search writes its trials there)
    base = dict(base or {})
    metric, mode = check_options(base, space, num_samples, scheduler, max_concurrent, metric, mode)
    checked = check_space(space, {k: v for k, v in base.items() if k != "out"})
    if scheduler == "pbt":
        if perturbation_interval < 1:
            raise ConfigError(
                f"--perturbation-interval must be >= 1 evaluation (got {perturbation_interval})")
        base = pbt_base(base, checked)
    if not resume:
        search_dir = place(base.pop("out", None) or new_search_dir(), flag="--out")
        check_writable(search_dir if isinstance(search_dir, Location) else str(search_dir), "--out")
        if search_dir.exists() and (not search_dir.is_dir() or any(search_dir.iterdir())):
            raise FileExistsError(f"--out {search_dir} already holds files: choose a new folder, or continue "
                                  f"that search with --resume {search_dir}")
    base.pop("out", None)
    # Ray and Tune only once the settings are known to be good.
    import ray
    from ray import tune

    from rayconv.api import release_actors
    from rayconv.cluster.connect import cluster_origin, connect, dashboard_url
    from rayconv.tune.trial import (END_STATES, EndStates, Trial, resolved_base, trial_resources,
                                    trial_settings)

    connect(base.get("address"))
    log(f"rayconv.tune: Ray: {cluster_origin()}")
    release_actors()   # (actors a run of this process kept would hold what the trials need)
    base_r = resolved_base(base)
    _check_fits(base_r, checked, trial_settings, ray.cluster_resources())
    search_dir = search_dir.absolute()
    search_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_json(search_dir / "search.json", {
            "space": space, "base": base, "num_samples": num_samples, "scheduler": scheduler,
            "max_concurrent": max_concurrent, "metric": metric, "mode": mode, "grace_period": grace_period,
            "reduction_factor": reduction_factor, "perturbation_interval": perturbation_interval,
            "synch": synch})
    # Tune's own per-trial logs (result.json, progress.csv) but not its TensorBoard files: each trial's
    # run writes its own into trial-<k>/tensorboard/, and a second set under tune/ would list every trial
    # twice in `tensorboard --logdir runs/`.
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    callbacks = [CSVLoggerCallback(), JsonLoggerCallback(), EndStates(str(search_dir)), *callbacks]
    CURRENT["search_dir"] = str(search_dir)
    # (each trial's run names the cluster's dashboard as this process was told it: dashboard_url)
    trainable = tune.with_resources(tune.with_parameters(Trial, base=base_r, search_dir=str(search_dir),
                                                         dashboard=dashboard_url()),
                                    trial_resources(base_r))
    # (a search in a store: Tune writes there through the same pyarrow file system, credentials and all)
    storage = {"storage_path": str(search_dir)} if isinstance(search_dir, Path) else \
        {"storage_path": search_dir.path, "storage_filesystem": search_dir.fs}
    if resume:
        tuner = tune.Tuner.restore(f"{storage['storage_path']}/tune", trainable=trainable,
                                   storage_filesystem=storage.get("storage_filesystem"),
                                   resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
        log(f"rayconv.tune: resuming {search_dir}")
    else:
        sched = make_scheduler(scheduler, checked, grace_period, reduction_factor, perturbation_interval,
                               synch)
        tuner = tune.Tuner(
            trainable, param_space=to_tune(checked),
            tune_config=tune.TuneConfig(metric=metric, mode=mode, num_samples=num_samples, scheduler=sched,
                                        max_concurrent_trials=max_concurrent,
                                        # (a trial's process, placement group and finished run's actors serve
                                        # the next trial; PBT restores trials from checkpoints instead)
                                        reuse_actors=scheduler != "pbt"),
            run_config=tune.RunConfig(**storage, name="tune", verbose=0, callbacks=list(callbacks),
                                      failure_config=tune.FailureConfig(max_failures=0),
                                      # (each of Tune's checkpoints is a copy of a run's: PBT needs the
                                      # newest)
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=2)))
        log(f"rayconv.tune: {_grid_size(checked) * num_samples} trial(s), {scheduler}, metric {metric} "
            f"({mode}) -> {search_dir}")
    END_STATES.pop(str(search_dir), None)
    with _no_default_loggers(), one_line_tune_logs():
        grid = tuner.fit()
    states = END_STATES.pop(str(search_dir), None)   # (None: a search made before EndStates, resumed)
    total = _grid_size(checked) * num_samples
    if states is not None:
        ended = sum(1 for v in states.values() if v in ("TERMINATED", "ERROR"))
    else:
        ended = grid.num_terminated + grid.num_errors
    interrupted = ended < total
    rows = table.collect(grid, search_dir, list(checked), metric, states)
    done = [r for r in rows if r["status"] in ("finished",) or r["status"].startswith("stopped early")]
    best = None if interrupted else table.best(done, metric, mode)
    table.write(search_dir, rows, best, metric)
    log(table.table(rows))
    if best:
        test = (f", test_accuracy {table.cell_text(best['test_accuracy'])}" if metric != "test_accuracy"
                else "")
        log(f"best: {best['trial']} ({metric} {best[metric]:.4f}{test}) -> {best['folder']}")
    if interrupted:
        log(f"rayconv.tune: interrupted: {ended} of {total} trial(s) ended; continue with "
            f"`python -m rayconv.tune --resume {search_dir}`")
    return SearchResult(search_dir, metric, rows, best, interrupted)


CURRENT: dict[str, str] = {}   # "search_dir": the folder of this process's search (``__main__``'s hint)


class _OneLine:
    """A logging filter for Tune's loggers during a search: a failed trial's error as one line (Tune logs
    its whole traceback; the trial's row holds the line too), and on an interrupted search the search's
    own words (Tune's resume hint is ``Tuner.restore``; the search prints ``--resume``'s)."""

    DROP = ("Experiment has been interrupted", "Trials did not complete")

    def filter(self, record) -> bool:
        text = str(record.msg)
        if text.startswith(self.DROP):
            return False
        if text.startswith("Stop signal received"):
            record.msg, record.args = ("rayconv.tune: interrupted: stopping the trials and saving the search "
                                       "(Ctrl-C again: at once)"), ()
        if text.startswith("Trial task failed") and record.exc_info:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {table.error_line(error)}"
            record.args, record.exc_info = (), None
        return True


@contextlib.contextmanager
def one_line_tune_logs():
    """Within: ``_OneLine`` on Tune's loggers of a search's run and its controller."""
    import logging

    loggers = [logging.getLogger(n) for n in ("ray.tune.tune", "ray.tune.execution.tune_controller")]
    one = _OneLine()
    for lg in loggers:
        lg.addFilter(one)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(one)


@contextlib.contextmanager
def _no_default_loggers():
    """Within: Tune adds no logger callbacks of its own (``TUNE_DISABLE_AUTO_CALLBACK_LOGGERS``, read when a
    search starts) and prints no console output of its own (``RAY_AIR_NEW_OUTPUT=0``: its reporter of
    verbosity 0, silent; the newer one prints its configuration box and a failed trial's error file at
    every verbosity): the search prints its own lines. The caller's environment as it was afterwards."""
    keys = {"TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1", "RAY_AIR_NEW_OUTPUT": "0"}
    before = {key: os.environ.get(key) for key in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_scheduler(scheduler: str, checked: dict[str, tuple[str, list]], grace_period: int,
                   reduction_factor: int, perturbation_interval: int, synch: bool = False):
    """Tune's scheduler: ASHA (cuts at evaluations), PBT (every ``perturbation_interval`` evaluations a
    trial of the lowest quarter continues one of the top quarter's checkpoint with the space's
    ``PBT_MUTABLE`` dimensions perturbed: x0.8 or x1.2, a neighbouring listed value, or a new draw;
    ``synch``: each trial waits there for the others, stopped and restarted from its checkpoint), or
    None (fifo)."""
    from ray import tune

    if scheduler == "asha":
        return tune.schedulers.ASHAScheduler(time_attr="training_iteration", max_t=MAX_T,
                                             grace_period=grace_period, reduction_factor=reduction_factor)
    if scheduler == "pbt":
        domains = to_tune(checked)
        mutations = {n: (list(values) if kind in ("grid", "choice") else domains[n])
                     for n, (kind, values) in checked.items() if n in PBT_MUTABLE}
        return tune.schedulers.PopulationBasedTraining(time_attr="training_iteration",
                                                       perturbation_interval=perturbation_interval,
                                                       hyperparam_mutations=mutations, synch=synch)
    return None


def _grid_size(checked: dict[str, tuple[str, list]]) -> int:
    """Trials per sample: the grids' values crossed."""
    n = 1
    for kind, values in checked.values():
        n *= len(values) if kind == "grid" else 1
    return n


def to_tune(checked: dict[str, tuple[str, list]]) -> dict[str, Any]:
    """The checked space as Tune's ``param_space``."""
    from ray import tune

    make = {"grid": tune.grid_search, "choice": tune.choice, "uniform": lambda v: tune.uniform(*v),
            "loguniform": lambda v: tune.loguniform(*v), "randint": lambda v: tune.randint(*v)}
    return {name: make[kind](values) for name, (kind, values) in checked.items()}


def _check_fits(base: dict[str, Any], checked: dict[str, tuple[str, list]], settings,
                cluster: dict[str, float]) -> None:
    """Refuse a trial whose placement group the whole cluster could not hold (Tune would wait for it
    for ever): the base layout and each listed value of the layout's dimensions. Raises ConfigError."""
    from rayconv.tune.trial import trial_bundles

    layout_dims = ("dp", "pp", "fs", "num_cpus_per_actor", "gpus_per_actor", "plan")
    samples = [{}] + [{n: v} for n, (kind, values) in checked.items()
                      if n in layout_dims and kind in ("grid", "choice") for v in values]
    for sample in samples:
        cfg = settings(base, sample)
        need: dict[str, float] = {}
        for b in trial_bundles(cfg):
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
        short = [f"{v:g} {k}" for k, v in need.items() if v > cluster.get(k, 0) + 1e-9]
        if short:
            what = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sample.items()) or "the base settings"
            raise ConfigError(f"a trial with {what} needs {', '.join(short)} (layout of {cfg.world_size} "
                              "actors) but the cluster has "
                              f"{', '.join(f'{cluster.get(k, 0):g} {k}' for k in need)}: lower the layout, "
                              "or --gpus-per-actor to pack actors onto GPUs")

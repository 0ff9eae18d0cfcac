"""One trial of a search: a normal rayconv run in ``<search>/trial-<k>/``, driven by Ray Tune.

``Trial`` is a Tune class trainable: ``setup`` starts ``rayconv.driver.job.train_run`` in a thread of the
trial's process, each evaluation's metrics (``on_eval``) become one Tune result (``step``) once the
step's checkpoint (if due) is written (``on_step``), and the run waits there until Tune asks for the
next result, so that a scheduler judges a trial at an evaluation and the trial trains no further
meanwhile. When Tune ends the trial (ASHA's early stop, the search
interrupted), ``cleanup`` stops the run as Ctrl-C stops one on the command line (``errors.RunStopped``:
actors stopped, config.json, metrics.parquet and a summary with status interrupted kept) and waits for
it, before Tune removes the trial's placement group.

Resources (``trial_resources``): the trial's process takes none (an empty head bundle); its
placement group holds one bundle per actor of its layout, which the run's actors take
(``cluster.acquire.given_group``). Tune so starts a trial only once its whole layout fits, and ending the
trial frees it all. Except under PBT, Tune hands a trial's process and placement group to the next
trial of the same resources (``reuse_actors``, ``reset_config``), and the actors of a run that finished
stay there for the next trial's run (``cluster.pool``: renewed, not started again).

A restarted trial (a resumed search) continues its run from the folder's newest checkpoint (with
``--checkpoint-every``); a folder without one is moved aside to ``trial-<k>.stopped-<n>`` and the run
starts over.

PBT (``save_checkpoint`` / ``load_checkpoint``): Tune's checkpoint of a trial is a copy of its run's
newest checkpoint (the one of the evaluation it reported) and ``BRANCH`` naming the trial. A trial
restored from another trial's (PBT's exploit, with its perturbed settings) moves its own folder aside
(``trial-<k>.stopped-<n>``), puts that checkpoint into a fresh ``trial-<k>/checkpoints/`` with
``BRANCH``, and continues from it as ``--resume`` does: the donor's steps and metrics rows up to there,
then its own settings.
"""

from __future__ import annotations

import ctypes
import json
import queue
import threading
from pathlib import Path
from typing import Any, Optional

from ray import tune

from rayconv.cluster.connect import available_devices, use_dashboard
from rayconv.cluster.acquire import actor_bundle
from rayconv.config import Config
from rayconv.errors import RunStopped
from rayconv.files import write_json
from rayconv.flags import from_mapping
from rayconv.outputs.checkpoint import latest_checkpoint
from rayconv.storage import Location, copy_tree, place, rename

STOP_WAIT_S = 120.0  # how long cleanup waits for a stopped run to record itself
BRANCH = "tune-branch.json"  # {"folder": the trial whose checkpoint it is, "step": its step (None: none yet)}


def trial_settings(base: dict[str, Any], sample: dict[str, Any], out: Optional[str] = None) -> Config:
    """The validated settings of one trial: ``base`` with the sampled ``sample`` over it (and ``out``)."""
    return from_mapping({**base, **sample, **({"out": out} if out else {})}).validate()


def trial_bundles(cfg: Config) -> list[dict[str, float]]:
    """The placement-group bundles of a trial running ``cfg`` (``device`` and ``dp`` resolved): an empty
    head (the trial's process takes nothing) and one actor bundle per actor of its layout."""
    return [{}] + [actor_bundle(cfg) for _ in range(cfg.world_size)]


def resolved_base(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``device`` (auto: cuda when the connected cluster has GPUs) and, when not given,
    ``dp`` (the cluster's devices over pp x fs, as a single run takes them) resolved, so that each
    trial's resources are known before it starts. Needs Ray connected."""
    cfg = from_mapping(base)
    kind, slots = available_devices(cfg.device)
    out = {**base, "device": kind}
    if cfg.dp is None:
        per = cfg.gpus_per_actor if kind == "cuda" else cfg.num_cpus_per_actor
        out["dp"] = max(1, int(slots / per + 1e-9) // (cfg.pp * cfg.fs))
    return out


def trial_resources(base: dict[str, Any]):
    """Tune's resources for a trial of the sampled ``config``: a PlacementGroupFactory (``trial_bundles``,
    PACK)."""
    def resources(config: dict[str, Any]) -> tune.PlacementGroupFactory:
        return tune.PlacementGroupFactory(trial_bundles(trial_settings(base, config)), strategy="PACK")
    return resources


def trial_index(trial_id: str) -> int:
    """The trial's number in its search: the counter Tune ends its trial ids with (``abc12_00003`` -> 3)."""
    tail = trial_id.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else abs(hash(trial_id)) % 10**6


class Trial(tune.Trainable):
    """A rayconv run as a Tune trial (module docstring). ``config``: the sampled settings; ``base``: the
    search's settings under them; ``search_dir``: the search folder; ``dashboard``: the cluster's Ray
    dashboard as the search's process was told it (its run's header names it: ``connect.use_dashboard``)."""

    def setup(self, config: dict[str, Any], base: dict[str, Any] = None, search_dir: str = "",
              dashboard: Optional[str] = None):
        use_dashboard(dashboard or "")   # (None: the search's process knew none)
        self.sample, self.base, self.search_dir = dict(config), dict(base or {}), search_dir
        self.folder = place(search_dir, flag="--out") / f"trial-{trial_index(self.trial_id)}"
        self.log_path = place(search_dir, flag="--out") / "logs" / f"{self.folder.name}.log"
        self.lines: list[str] = []   # (a search in a store: the log so far, uploaded whole at each line)
        self.results: queue.Queue = queue.Queue()
        self.go = threading.Semaphore(0)
        self.stopping = False
        self.waiting = False        # the run is at an evaluation, waiting for ``go``
        self.pending: Optional[dict[str, Any]] = None   # an evaluation's metrics, reported after its step
        self.thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the run, in its thread
    def _settings(self) -> Config:
        """The run's settings: a fresh folder, or the newest checkpoint of an unfinished one."""
        folder = self.folder
        if folder.exists() and any(folder.iterdir()):
            if latest_checkpoint(folder) is not None:   # continued from its newest checkpoint
                return from_mapping({**self.base, **self.sample, "out": str(folder),
                                     "resume": str(folder)}).validate()
            self._move_aside()
        return trial_settings(self.base, self.sample, str(folder))

    def _move_aside(self) -> None:
        """The trial's folder renamed ``trial-<k>.stopped-<n>`` (the first free n), kept whole."""
        n = 1
        while (self.folder.parent / f"{self.folder.name}.stopped-{n}").exists():
            n += 1
        rename(self.folder, self.folder.parent / f"{self.folder.name}.stopped-{n}")

    def _log(self, line: str) -> None:
        if isinstance(self.log_path, Location):
            self.lines.append(line)
            self.log_path.write_text("".join(f"{x}\n" for x in self.lines))
            return
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def _on_eval(self, row: dict[str, Any], total_steps: int) -> None:
        metrics = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k not in ("kind",)}
        metrics["steps"] = total_steps
        if row["step"] + 1 >= total_steps:   # the run goes on to write model.pt and its summary
            self.results.put(("final", metrics))
        else:
            self.pending = metrics

    def _on_step(self, actor_group, step: int) -> None:
        """After a step's evaluation and its checkpoint: the evaluation reported, then the wait for Tune."""
        if self.pending is None:
            return
        metrics, self.pending = self.pending, None
        self.results.put(("eval", metrics))
        self.waiting = True
        self.go.acquire()
        self.waiting = False
        if self.stopping:
            raise RunStopped(f"Tune ended the trial after step {step} (early stop or the search's end)")

    def _run(self) -> None:
        from rayconv.driver.job import train_run

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            summary_path = self.folder / "summary.json"
            if summary_path.is_file() and json.loads(summary_path.read_text()).get("status") == "finished":
                summary = json.loads(summary_path.read_text())     # done before the search was stopped
                self.results.put(("final", {k: v for k, v in summary.items() if isinstance(v, (int, float))}))
            else:
                cfg = self._settings()
                summary = train_run(cfg, log=self._log, on_step=self._on_step, on_eval=self._on_eval)
            self.results.put(("done", summary))
        except RunStopped as e:
            self.results.put(("stopped", str(e)))
        except BaseException as e:  # noqa: BLE001 - the trial fails, the search goes on
            self.results.put(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))

    # ------------------------------------------------------------------ Tune's side
    def step(self) -> dict[str, Any]:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"rayconv-{self.folder.name}", daemon=True)
            self.thread.start()
        else:
            self.go.release()
        kind, payload = self.results.get()
        if kind == "eval":
            return payload
        if kind == "final":
            last = payload
            kind, payload = self.results.get()
            if kind == "done":
                return {**last, "done": True}
        if kind == "error":
            raise TrialFailed(payload)
        raise TrialFailed(f"the run ended without finishing: {payload}")

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Tune's checkpoint of the trial: a copy of its run's newest checkpoint and ``BRANCH`` (module
        docstring). Tune calls it between results, while the run waits at an evaluation."""
        newest = latest_checkpoint(self.folder) if self.folder.is_dir() else None
        if newest is not None:
            try:
                copy_tree(newest, Path(checkpoint_dir) / "checkpoints" / newest.name)
            # (deleted as the run wrote a newer one: Tune asked mid-step) no branch from this
            except OSError:
                newest = None
        write_json(Path(checkpoint_dir) / BRANCH,
                   {"folder": str(self.folder), "step": int(newest.name.split("-")[1]) if newest else None})

    def load_checkpoint(self, checkpoint: Any) -> None:
        """Restored from Tune's checkpoint ``checkpoint`` (a folder): its own, nothing to do (the run
        continues from its folder); another trial's, branch from it (module docstring)."""
        src = Path(checkpoint) if isinstance(checkpoint, (str, Path)) else None
        if src is None or not (src / BRANCH).is_file():
            return
        mark = json.loads((src / BRANCH).read_text())
        here = self.folder / BRANCH
        if mark["step"] is None or mark["folder"] == str(self.folder) or (
                # (branched before: a resumed search)
                here.is_file() and json.loads(here.read_text()) == mark):
            return
        if self.folder.exists():
            self._move_aside()
        step_dir = f"step-{mark['step']}"
        copy_tree(src / "checkpoints" / step_dir, self.folder / "checkpoints" / step_dir)
        write_json(here, mark)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log(f"rayconv.tune: continues {Path(mark['folder']).name}'s checkpoint of step {mark['step']} "
                  "with " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.sample.items()))

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """This process (and its placement group) taken for another trial (``reuse_actors``; Tune has set
        the new trial's id): the last trial's run stopped if it is still going, then set up as a new
        trial. Its actors, kept when its run finished (``cluster.pool``), serve the new trial's run."""
        self.cleanup()
        self.setup(new_config)   # (``tune.with_parameters`` passes base, search_dir and dashboard again)
        return True

    def cleanup(self) -> None:
        """Stop the run if it is still going (as Ctrl-C would) and wait for it to record itself."""
        if self.thread is None or not self.thread.is_alive():
            return
        self.stopping = True
        if not self.waiting:   # mid-step: interrupt it where it is, as Ctrl-C does a command-line run
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread.ident),
                                                       ctypes.py_object(RunStopped))
        self.go.release()
        self.thread.join(STOP_WAIT_S)


class TrialFailed(RuntimeError):
    """A trial's run failed; the message is its one-line error."""


# search folder -> {trial number: Tune's status of the trial when the search ended} (``EndStates``)
END_STATES: dict[str, dict[int, str]] = {}


class EndStates(tune.Callback):
    """Records each trial's status as Tune's loop last saw it (``on_step_end``: after a Ctrl-C the loop
    stops there, before Tune's clean-up marks the trials it stops TERMINATED): TERMINATED (finished, or
    stopped early by the scheduler), ERROR, or RUNNING / PAUSED / PENDING (the search was interrupted),
    into ``END_STATES`` under the search folder (a resumed search gets the callback back from Tune's saved
    state: a copy, which records there alike)."""

    def __init__(self, search_dir: str):
        self.search_dir = search_dir

    def on_step_end(self, iteration, trials, **info):
        END_STATES[self.search_dir] = {trial_index(t.trial_id): str(t.status) for t in trials}

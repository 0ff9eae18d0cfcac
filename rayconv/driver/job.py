"""The driver as a controller: one run's states and the decisions that move it between them.

    resolve -> acquire -> build -> train -> finish
                 ^                  |  (a step boundary: the scaling policy decides a resize)
                 |                  +-> checkpoint -> resize --+
                 |                  |  (actors lost: the failure policy decides)
                 +------------------+-> restart | resize ------+

- resolve: checks, data, model, layout, routing: one frozen ``ResolvedRun`` (resolve.py);
- acquire: the actors (``cluster.acquire``: started early, kept by a previous run or command, or new);
- build: each actor's part of the model cut from the routing, its optimizer, the checkpoint loaded;
- train: one call per actor per step, two in flight (loop.py), until the last step or a resize;
- checkpoint: a preemption notice's checkpoint at the step boundary (no finished step lost);
- resize (--elastic, elastic.py): the layout the scaling policy picks from the free devices;
- restart: new actors on the same layout from the last checkpoint (--max-failures F: F times);
- finish: model.pt, metrics.parquet, summary.json (finish.py); the actors kept or stopped.

The policies (``policies.py``) are plain functions of plain inputs: the scaling policy (fixed, or
``--elastic MIN``) at each step boundary and once the actors stopped, the failure policy after a loss.
With --evaluate-only the actors, once set up with --init's weights, evaluate them and the run ends
(``finish_evaluation``). Tensors of the training path never pass through the driver: it sends each
actor its rank and the routing once, then one small call per step.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Optional

from rayconv.actor.actor import Actor
from rayconv.cluster.acquire import ActorSpec, acquire, release, release_started
from rayconv.cluster.group import ActorGroup
from rayconv.config import Config
from rayconv.data.source import Sharding
from rayconv.driver.early import REFUSALS
from rayconv.driver.elastic import cluster_free, continue_mesh, first_words, memory_fits, wait_for_devices
from rayconv.driver.finish import (events_closed, finish, finish_evaluation, held_decode, recording_stop,
                                  writing_into)
from rayconv.driver.loop import Run, checkpoint, train
from rayconv.driver.policies import (CONTINUE, Decision, ElasticScaling, FailurePolicy, FixedScaling,
                                     ScalingPolicy)
from rayconv.driver.progress import kept_names, log_header
from rayconv.driver.resolve import ResolvedRun, call_timeout_s, resolve_run
from rayconv.driver.saving import check_nodes, settle
from rayconv.errors import CallTimeout, ClusterError
from rayconv.layout import Layout
from rayconv.mesh import Mesh
from rayconv.outputs.checkpoint import (Checkpoint, check_resumable, latest_checkpoint, load_checkpoint,
                                       rank_file_for)
from rayconv.parallel.routing import Routing
from rayconv.signals import sigterm_as_interrupt
from rayconv.startup import claim, mark


def train_run(cfg: Config, log=print, on_step=None, on_eval=None, run_name: Optional[str] = None,
              ) -> dict[str, Any]:
    """Train as ``cfg`` says; write config.json, metrics.parquet, summary.json and model.pt into the
    output folder (and checkpoints/ every ``cfg.checkpoint_every`` steps); return the summary.
    ``on_step(actor_group, step)``, if given, is called after each step (tests use it to inspect every actor);
    ``on_eval(row, total_steps)`` after each evaluation, with its metrics row (``step``, ``test_accuracy``,
    ... and the last ``train_loss``): raising ``errors.RunStopped`` there stops the run as Ctrl-C does.
    ``run_name``: the name the run's actors started under before torch was imported
    (``driver.early.start_first``; else they start once the layout is known, ``driver.early``, under a new
    name).
    Raises ConfigError / DataError / LayoutError / CheckpointError before anything is written,
    ClusterError if an actor fails more than ``cfg.failure_budget`` times. A run stopped by Ctrl-C or
    SIGTERM after a step keeps its folder: config.json, metrics.parquet of the steps done, summary.json
    with ``status`` interrupted (``finish.record_stop``). On a failure the folder is removed if this run
    made it and it holds no result yet (a checkpoint or metrics.parquet); results are never deleted.
    """
    claim().mark("imports")                            # the start-up clock (rayconv.startup)
    controller = Controller(cfg, run_name, log, on_step, on_eval)
    try:
        return controller.run()
    except REFUSALS:   # (the actors started early, unused: the corrected run of this process takes them)
        release_started(controller.run_name, keep=cfg.keep_actors_s)
        raise
    finally:
        release_started(controller.run_name)   # (any other failure before the run took them: none left)


class State(enum.Enum):
    """The controller's states (the module docstring's diagram; docs/architecture.md, "The driver: a
    controller")."""

    RESOLVE = "resolve"
    ACQUIRE = "acquire"
    BUILD = "build"
    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    RESIZE = "resize"
    RESTART = "restart"
    FINISH = "finish"


class Controller:
    """One run through the states of the module docstring. ``states``: every state entered, in order."""

    def __init__(self, cfg: Config, run_name: Optional[str], log, on_step, on_eval):
        self.cfg, self.log, self.on_step, self.on_eval = cfg, log, on_step, on_eval
        self.run_name = run_name   # the actors' name on the cluster: given, or the one the actors start under
        self.states: list[State] = []
        self.start: Optional[ResolvedRun] = None   # the run as resolved: --elastic's starting layout
        self.config_written = False   # config.json: once the first actors are set up

    def to(self, state: State) -> None:
        self.states.append(state)

    def run(self) -> dict[str, Any]:
        self.to(State.RESOLVE)
        self.start = resolved = resolve_run(self.cfg, self.log, on_layout=self.start_early,
                                            run_name=self.run_name)
        self.run_name = resolved.run_name
        run = Run(resolved, self.log, self.on_step, self.on_eval, scaling=scaling_policy(resolved))
        failure = FailurePolicy(resolved.cfg.failure_budget, elastic=run.scaling.watches_cluster)
        # SIGTERM stops the run as Ctrl-C does; a stop leaves the steps' metrics and a summary saying how
        # the run ended; on failure only results stay (checkpoints, metrics), not a bare config.json.
        with (sigterm_as_interrupt(), writing_into(resolved.out, self.log), events_closed(run),
              recording_stop(run)):
            log_header(resolved, self.log)
            ckpt = resolved.resume
            while True:
                try:
                    summary, decision = self.attempt(run, ckpt)
                except ClusterError as e:   # actors lost (and stopped): the failure policy decides
                    e, decision = decide_after_loss(e, run, failure)
                    ckpt = self.after_loss(run, e, decision)
                    continue
                if summary is not None:
                    return summary
                written = load_checkpoint(latest_checkpoint(run.resolved.out))   # (the boundary's)
                ckpt = self.resize(run, decision, time.monotonic(), written)

    def start_early(self, cfg: Config, mesh: Mesh, run_name: str) -> Optional[ActorGroup]:
        """The actors started while resolve still checks (``driver.early``), under ``run_name``."""
        self.run_name = run_name
        return acquire(ActorSpec(Actor, cfg, mesh, run_name), early=True)

    def attempt(self, run: Run, ckpt: Optional[Checkpoint]) -> tuple[Optional[dict[str, Any]], Decision]:
        """acquire -> build -> train -> finish (the summary), or -> checkpoint (a preemption) until a
        resize (the scaling policy's decision); the actors stopped or kept on the way out. Raises
        ClusterError when actors are lost."""
        self.to(State.ACQUIRE)
        # (Ctrl-C is recorded before the actors are stopped: that can wait on a cluster going down too)
        with acquire_actors(run) as actor_group, \
                recording_stop(run, KeyboardInterrupt):
            self.to(State.BUILD)
            build_run(run, actor_group, ckpt)
            if not self.config_written:   # once the actors are set up: a failed start (a --resume in place
                # among them) leaves the folder's config.json as it was; written whole (atomic)
                self.start.saved_config().to_json(self.start.out / "config.json")
                self.config_written = True
            if run.cfg.evaluate_only:
                self.to(State.FINISH)
                return kept_after(run, actor_group, finish_evaluation(run, actor_group)), CONTINUE
            self.to(State.TRAIN)
            decision = train(run, actor_group, start=ckpt.step if ckpt is not None else 0)
            if decision.action == "continue":
                self.to(State.FINISH)
                return kept_after(run, actor_group, finish(run, actor_group)), decision
            done = steps_done(run)
            if not run.checkpoint_due(done):   # a preemption between checkpoints: no finished step lost
                self.to(State.CHECKPOINT)
                checkpoint(run, actor_group, done, wait=True)
                run.metrics.write(run.resolved.out / "metrics.parquet")
            run.log(f"rayconv: step {done}: {decision.why}: the actors stop after the checkpoint of step "
                    f"{done}; the run continues on the layout --elastic picks")
            return None, decision

    def after_loss(self, run: Run, e: ClusterError, decision: Decision) -> Optional[Checkpoint]:
        """restart (the same layout) or resize (--elastic) after ``e``, counted against --max-failures:
        the checkpoint to continue from (the run's newest, else the one it resumed from, else None: the
        start); a loss after the last step (during the final export) continues from the last step's
        checkpoint: the new actors load it and export."""
        t_detect = time.monotonic()
        run.failures += 1
        settle(run, None)   # (the lost actors' checkpoints dropped; a manifest being written, written)
        latest = latest_checkpoint(run.resolved.out)
        ckpt = load_checkpoint(latest) if latest is not None else run.resolved.resume
        budget = run.cfg.failure_budget
        of = f"; --max-failures {budget}: no limit" if budget < 0 else f" of --max-failures {budget}"
        run.log(f"rayconv: {e}\nrayconv: recovering ({run.failures}{of}): new actors, "
                f"continuing from {ckpt.path if ckpt else 'the start'}")
        if decision.action == "resize":
            return self.resize(run, decision, t_detect, ckpt)
        self.to(State.RESTART)
        return ckpt

    def resize(self, run: Run, decision: Decision, t_detect: float, ckpt: Optional[Checkpoint]
               ) -> Optional[Checkpoint]:
        """--elastic, the actors stopped: up to --elastic-wait for the devices worth waiting for, then
        ``run`` onto the layout the scaling policy picks from the free devices (within --max-wait),
        continuing from ``ckpt`` (checked against the new layout: returned). Raises TooFewDevices below
        --elastic, CheckpointError when the checkpoint cannot be cut for the new layout."""
        self.to(State.RESIZE)
        scaling, old, start = run.scaling, run.resolved, self.start
        assert isinstance(scaling, ElasticScaling) and start is not None
        done = steps_done(run)
        run.preempted = None

        def free() -> int:
            return cluster_free(run.cfg)

        wait_for_devices(free, scaling.devices_to_wait_for(old.mesh, decision.why), run.cfg.elastic_wait)
        devices_free = round(time.monotonic() - t_detect, 3)
        new = start.on_mesh(continue_mesh(scaling, run.cfg.max_wait, old.out, run.log, free))
        if ckpt is not None:
            check_resumable(ckpt, new.cfg, new.mesh, new.routing.stages, new.source.num_classes,
                            tuple(new.source.sample_shape))
        run.use(new)
        step = ckpt.step if ckpt is not None else 0
        run.changes.begin(step, Layout.from_config(old.cfg).name, run.layout_name, decision.why,
                          max(0, done - step), t_detect, devices_free)
        return ckpt


def scaling_policy(resolved: ResolvedRun) -> ScalingPolicy:
    """--elastic MIN's policy over the resolved layout, else the fixed one."""
    cfg = resolved.cfg
    if cfg.elastic is None:
        return FixedScaling(resolved.mesh)
    return ElasticScaling(resolved.mesh, cfg.elastic, cfg.global_batch_size, cfg.num_microbatches,
                          memory_fits(cfg))


def steps_done(run: Run) -> int:
    """The steps the metrics record as done (the last train row's step + 1; 0 for none)."""
    return next((r["step"] + 1 for r in reversed(run.metrics.rows) if r["kind"] == "train"), 0)


def decide_after_loss(e: ClusterError, run: Run, failure: FailurePolicy) -> tuple[ClusterError, Decision]:
    """The failure policy's decision after actors failed with ``e`` (and were stopped): (``e`` with a
    timeout's hint, restart | resize). Raises ``e`` when it is not recoverable, and when the failures
    left are spent with what to give to recover from more."""
    e = with_timeout_hint(e)
    decision = failure.decide(first_words(str(e)), e.recoverable, run.failures)
    if decision.action == "stop":
        raise (type(e)(f"{e}; {decision.why}", True) if e.recoverable else e) from None
    return e, decision


def with_timeout_hint(e: ClusterError) -> ClusterError:
    """``e``, a call that timed out with the limit and what to raise said."""
    if isinstance(e, CallTimeout):
        return CallTimeout(f"{e}; the limit is 2 x --collective-timeout-s + 30 s: raise "
                           "--collective-timeout-s if the work is only slow", recoverable=True)
    return e


def kept_after(run: Run, actor_group: ActorGroup, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary``, once the actors of the run that ended are kept (--keep-actors-s) instead of stopped
    (``cluster.acquire.release``): on the cluster for the next command where they may outlive this one,
    else for the next run of this process."""
    n = len(actor_group.actors)
    if release(actor_group, keep=run.cfg.keep_actors_s) == "cluster":
        run.log(f"rayconv: {n} actors stay on the cluster for {run.cfg.keep_actors_s:g} s, for the next "
                "command that needs them (--keep-actors-s 0: stopped at the end instead)")
    return summary


def acquire_actors(run: Run) -> ActorGroup:
    """The run's actors, alive (within --max-wait): ``cluster.acquire.acquire`` (started early, kept, or
    new). Raises ClusterError; the actors are stopped on any failure."""
    s = run.resolved
    actor_group = acquire(ActorSpec(Actor, s.cfg, s.mesh, s.run_name))
    mark("actors_alive")
    if actor_group.across:
        run.log(f"rayconv: {len(actor_group.actors)} actors kept on the cluster by a previous command, "
                f"reused (--keep-actors-s){kept_names(actor_group.names, s.run_name)}")
    elif actor_group.reused:
        n, spare = len(actor_group.actors), len(actor_group.spare)
        line = (f"rayconv: {n} actors kept from this process's previous run, reused (--keep-actors-s)"
                if not spare else f"rayconv: {n} of the {n + spare} actors kept from this process's "
                f"previous run, reused; the other {spare} wait in its placement group until this run "
                "ends (--keep-actors-s 0: not kept)")
        run.log(line + kept_names(actor_group.names, s.run_name))
    run.changes.mark("actors_alive")
    return actor_group


def build_run(run: Run, actor_group: ActorGroup, ckpt: Optional[Checkpoint]) -> None:
    """Check that the actors' nodes can write the run's checkpoints into its store (``check_nodes``), set
    the actors up under the run's resolved settings (``build_actors``) and load ``ckpt`` (and its metrics
    rows) if given. Raises ClusterError, StorageError."""
    s = run.resolved
    check_nodes(run, actor_group)   # (a node that cannot write the run's checkpoints: one line, exit 2)
    run.actor_reports = build_actors(actor_group, s.mesh, s.routing, s.sharding, run.call_timeout_s, s.cfg)
    mark("actors_set_up")
    run.changes.mark("actors_set_up")
    run.startup.mark_actors(run.actor_reports)
    decode = held_decode(run.actor_reports)
    if decode is not None:
        run.log(f"rayconv: {'read' if s.cfg.raw_pixels else 'decoded'} {decode['decoded_images']} images in "
                f"{decode['decode_s']:.1f} s on {decode['decode_workers']} workers (data held on the device; "
                "before the first step)")
    run.continue_from(ckpt)
    if ckpt is not None:
        files = [(rank_file_for(ckpt, s.mesh, r), ckpt.step) for r in range(s.mesh.world_size)]
        actor_group.call_each(Actor.load_rank_file, files, timeout_s=run.call_timeout_s)
        run.changes.mark("checkpoint_loaded")


def build_actors(actor_group: ActorGroup, mesh: Mesh, routing: Routing, sharding: Sharding, timeout_s: float,
                 cfg: Optional[Config] = None) -> list[dict[str, Any]]:
    """Each actor's ``build``: process groups (rank 0's address the rendezvous), its part of the model
    cut from the routing, the optimizer, the train sharding it reads by, under ``cfg`` (None: the
    settings the actors were started with). Returns their reports in rank order."""
    master = actor_group.call(Actor.open_rendezvous, ranks=[0], timeout_s=timeout_s)[0]
    settings = None if cfg is None else cfg.to_dict()
    args = [(r, master, routing, sharding, settings) for r in range(mesh.world_size)]
    return actor_group.call_each(Actor.build, args, timeout_s=timeout_s)


def launch(cfg: Config, mesh: Mesh, routing: Routing, sharding: Sharding, run_name: str,
           timeout_s: float = 120.0) -> tuple[ActorGroup, list[dict[str, Any]]]:
    """Start the actors of ``cfg`` (resolved, with mesh, routing and sharding as
    ``resolve.resolve_on_cluster`` returns them) and set them up, for a caller with its own step loop (the
    bench). Returns (actor_group, setup reports). Raises ClusterError."""
    actor_group = acquire(ActorSpec(Actor, cfg, mesh, run_name, timeout_s))
    try:
        return actor_group, build_actors(actor_group, mesh, routing, sharding, call_timeout_s(cfg))
    except BaseException:
        actor_group.kill()
        raise

"""A run's setup, done once before the actors' setup: checks, data, model, layout, routing, output folder.

The settings themselves (also for a ``Config`` made in Python), a ``--resume`` checkpoint's files and
steps left, a user's ``--model`` found and the output folder are checked first, before Ray:
milliseconds. The checks that need no
cluster but take longer (the model name, ``--max-memory-gib``, the data, the model's training output,
the learning-rate warm-up against the run's length, the layout against the model, the checkpoint
against the run) come before Ray too when nothing is to start meanwhile (``resolve_on_cluster``
without ``on_layout``) or when the model's checks have not passed for these settings on this machine
(``driver.passed``); else a run (``resolve_run`` with ``on_layout``) first connects Ray and resolves the
device and ``dp``, has its actors started (``driver.early``: their processes import torch meanwhile),
then checks. Then the routing (``parallel.routing.make_routing``) is built for the resolved mesh. Each
resolution makes a new, validated ``Config`` (``dataclasses.replace``); the result is one frozen
``ResolvedRun`` that the loop, the checkpoints and the summary read.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray

from rayconv.choices import SMALL_DATA_BYTES
from rayconv.cluster.capacity import resolve_layout
from rayconv.cluster.connect import connect_run, node_memory_share
from rayconv.cluster.local_copy import copy_to_nodes
from rayconv.cluster.tasks import gpu_free_bytes, gpu_total_bytes, run_on_device
from rayconv.config import Config
from rayconv.data.order import make_order
from rayconv.data.registry import check_source
from rayconv.data.small import decide_auto, held_bytes, is_held
from rayconv.data.source import Sharding, Source
from rayconv.driver.early import needs_devices
from rayconv.driver.lr import check_schedule, total_steps
from rayconv.driver.passed import passed, remember
from rayconv.driver.prestart import open_output, with_output_folder

from rayconv import startup
# --cudnn-benchmark auto: on for runs at least this long
from rayconv.choices import CUDNN_BENCHMARK_MIN_STEPS
from rayconv.errors import CheckpointError, ClusterError, ConfigError, LayoutError
from rayconv.mesh import Mesh
from rayconv.model_names import is_torchvision_model
from rayconv.models import build_model, model_names
from rayconv.user_model import is_user_model, resolve
from rayconv.models.weights import init_file
from rayconv.outputs.checkpoint import Checkpoint, check_resumable, check_resumes_newest, load_checkpoint
from rayconv.parallel.routing import Routing, checked_routing, make_routing
from rayconv.storage import Place
from rayconv.planner.layer_timing import measured_costs
from rayconv.planner.memory import GIB, gpu_share_problem
from rayconv.planner.search import choose_layout, memory_check, predicted_peak_gib


@dataclass(frozen=True)
class ResolvedRun:
    """What one run is, resolved once: the settings (device, pipeline cut and output folder filled in),
    the routing every actor cuts its part from (its ``mesh`` is the run's: the one place of ``dp``), the
    data, the step counts. ``cfg`` is ``settings`` with the mesh's ``dp``; the train ``sharding`` holds
    no dp (its ``replica_batch`` takes the mesh's)."""

    settings: Config           # their dp is the mesh's: stored as None here, read through ``cfg``
    routing: Routing
    source: Source
    sharding: Sharding
    total_steps: int
    eval_every: int            # steps between test evaluations
    out: Place                 # the output folder (made when the run starts; a storage.Location in a store)
    run_name: str              # on the cluster: placement group, actor names, the gauges' tag
    resume: Optional[Checkpoint]
    predicted: Optional[dict[str, Any]]  # --layout auto: the planner's prediction, for summary.json
    t_start: float             # time.perf_counter() when the setup began: the summary's wall time
    data_dir: Optional[str] = None  # --data-dir as given (cfg.data_dir is --stage-dir's copy when staged)

    def __post_init__(self) -> None:
        if self.settings.dp is not None:
            object.__setattr__(self, "settings", dataclasses.replace(self.settings, dp=None))

    @property
    def mesh(self) -> Mesh:
        """The run's ``dp x pp x fs`` mesh: the routing's."""
        return self.routing.mesh

    @functools.cached_property
    def cfg(self) -> Config:
        """The run's settings with the mesh's ``dp``: what the actors, the checkpoints and config.json get."""
        return dataclasses.replace(self.settings, dp=self.mesh.dp)

    def on_mesh(self, mesh: Mesh) -> "ResolvedRun":
        """This run on ``mesh`` (--elastic: another dp, the same pp and fs): the routing on ``mesh``; the
        pipeline cut, the schedule and the rest stay (the routing's stages do not depend on dp), and so
        the settings and the sharding, which read dp from the mesh. Raises ConfigError for a dp the
        settings refuse."""
        if mesh == self.mesh:
            return self
        if (mesh.pp, mesh.fs) != (self.mesh.pp, self.mesh.fs):
            raise ValueError(f"a run changes only its dp: {self.mesh} -> {mesh}")
        dataclasses.replace(self.settings, dp=mesh.dp).validate()   # (the batch split over dp, ...)
        return dataclasses.replace(self, routing=dataclasses.replace(self.routing, mesh=mesh))

    def saved_config(self) -> Config:
        """The settings config.json and a checkpoint record: the resolved ones, ``data_dir`` as given (a
        resumed run stages its copies again from there, also to nodes that have none)."""
        return dataclasses.replace(self.cfg, data_dir=self.data_dir)


def resolve_run(cfg: Config, log=print, on_layout=None, run_name: Optional[str] = None) -> ResolvedRun:
    """Check and resolve everything a run needs before its actors' setup (see the module docstring).
    ``on_layout(cfg, mesh, run_name)``, if given, is called once the device and the mesh are known,
    before the checks that take longer (``resolve_on_cluster``); ``run_name``: the name the actors
    started under (``driver.early.start_first``), else a new one. Nothing is written. Raises
    ConfigError / DataError / LayoutError / CheckpointError / FileExistsError (the settings and the
    output folder's before Ray starts), ClusterError when the cluster cannot be reached."""
    t_start = time.perf_counter()
    cfg.validate()  # (a Config made in Python: refused here, before Ray starts)
    resume = load_checkpoint(cfg.resume) if cfg.resume else None
    cfg = with_output_folder(cfg, resume)
    # (a local folder in full: the header, the summary and the messages name it)
    out, new_name = open_output(cfg, None if resume is None else resume.run_dir)
    if resume is not None:
        check_resumes_newest(resume, out)
    check_named(cfg, resume)
    predicted = None
    if cfg.layout == "auto":
        cfg, predicted = choose_layout(cfg, log)
    data_dir = cfg.data_dir
    run_name = run_name or new_name
    started = None if on_layout is None else (lambda c, m: on_layout(c, m, run_name))
    cfg, mesh, source, routing, sharding = resolve_on_cluster(cfg, log, resume, on_layout=started)
    steps = total_steps(cfg, sharding.steps_per_epoch)
    cfg = with_cudnn_benchmark(cfg, steps)
    assert routing.mesh == mesh and cfg.dp == mesh.dp
    return ResolvedRun(settings=cfg, routing=routing, source=source, sharding=sharding,
                       total_steps=steps, eval_every=cfg.eval_every or sharding.steps_per_epoch, out=out,
                       run_name=run_name, resume=resume, predicted=predicted, t_start=t_start,
                       data_dir=data_dir)


def check_named(cfg: Config, resume: Optional[Checkpoint]) -> None:
    """The checks of what the settings name that take milliseconds, before Ray: a user's ``--model``
    found (its file, module and function: imported, with the torch the driver imported already), the
    ``--init`` file found, and a ``resume`` checkpoint with a step left before ``--steps``. Raises
    ConfigError / CheckpointError."""
    if is_user_model(cfg.model):
        resolve(cfg.model)
    if cfg.init:
        init_file(cfg.init)
    if resume is not None and cfg.steps:  # (with --epochs the run's length needs the data's size)
        check_steps_left(resume, cfg.steps)


def with_cudnn_benchmark(cfg: Config, steps: int) -> Config:
    """``cfg`` with ``--cudnn-benchmark auto`` resolved: on from ``CUDNN_BENCHMARK_MIN_STEPS`` steps. cuDNN's
    timing of each new convolution shape costs seconds (the first step, the last partial batch, the first
    evaluation) and its choice saves a share of every later step: the break-even is thousands of steps
    (benchmarks/RESULTS.md, Fashion-MNIST)."""
    if cfg.cudnn_benchmark != "auto":
        return cfg
    return dataclasses.replace(cfg, cudnn_benchmark="on" if steps >= CUDNN_BENCHMARK_MIN_STEPS else "off")


def resolve_on_cluster(cfg: Config, log=print, resume: Optional[Checkpoint] = None,
                       on_layout=None) -> tuple[Config, Mesh, Source, Routing, Sharding]:
    """Check everything that needs no cluster, connect to Ray, resolve the layout against the cluster
    and build the routing.

    The checks that need no cluster (``check_before_ray``: the data's folders and metadata, the model's
    name, image shape and training output, the layout against the model with --dp as given, 1 when
    the cluster decides it, and ``resume``'s checkpoint against the run) come before Ray, or, with
    ``on_layout``, where the actors may start early (``driver.early.needs_devices``) and the model's checks
    passed for these settings on this machine before (``driver.passed``), right after
    the layout is resolved and ``on_layout(cfg, mesh)`` was called (the actors start meanwhile); where
    the cluster lacks the layout's devices then, before the wait for them (--max-wait). With
    --stage-dir, the shards are then copied to the nodes (``cluster.local_copy``).
    Returns (the settings with device, ``dp``, a balanced pipeline cut and a staged ``data_dir``
    resolved; mesh; source; routing; the train sharding, which the actors read by over the mesh's
    replicas). Raises ConfigError / DataError / LayoutError / CheckpointError / ClusterError
    before any actor's setup."""
    early = on_layout is not None and not needs_devices(cfg) and passed(cfg)
    given = cfg
    if not early:
        source, sharding, reference, checked = check_before_ray(cfg, resume)
        startup.mark("data")
    dp_given = cfg.dp is not None
    connect_run(cfg)   # (nothing when driver.early.start_first connected this run)
    try:
        cfg, mesh = resolve_layout(cfg, log, wait=not early)
    except ConfigError:
        if not early:
            raise
        # The cluster lacks the layout's devices now: what the model alone rules out (--pp above its layers,
        # --fs above its channels) is refused first, as without early actors, before any wait for devices.
        source, sharding, reference, checked = check_before_ray(given, resume)
        startup.mark("data")
        early = False
        cfg, mesh = resolve_layout(cfg, log)
    if early:
        group = on_layout(cfg, mesh)
        source, sharding, reference, checked = check_before_ray(given, resume, WarmCheck.of(group, given))
        startup.mark("data")
    check_gpu_share(cfg)
    cfg, source = with_data_on_device(cfg, mesh, source, log)
    cfg = copy_to_nodes(cfg, log)  # --stage-dir: the shards copied to each node; the actors read the copies
    if not dp_given:
        memory_check(cfg)  # (with --dp from the cluster: before any actor starts)
    cfg, routing = resolve_routing(cfg, mesh, checked, reference, source, log)
    # (the order made once, before Ray; the replica count is the mesh's)
    return cfg, mesh, source, routing, sharding


class ActorCheckLost(Exception):
    """A new actor checking the model did not start (``WarmCheck.routing``): the driver checks it itself,
    and the actors' start reports what stopped them."""


class WarmCheck:
    """The model's checks and routings (``routing.checked_routing``) made by rank 0 of the run's actors,
    whose warm-up imports torchvision, for a driver that has not imported it: a torchvision model's check
    here would import it, and torch._dynamo with it (seconds at every command's start, beside the same
    import in the actors). The actors are those a previous run kept (``--keep-actors-s``), or those this
    run started early (``driver.early``: the call waits in the actor's queue for its start and warm-up).
    ``of(group, cfg)`` -> a WarmCheck, or None where the driver checks itself: no group, rayconv's own or
    a user's model (fast here, or imported here already), ``--init`` (its file may lie on the driver's
    machine alone), torchvision already imported here. ``routing`` raises what the check raised
    (ConfigError / LayoutError); for kept actors ClusterError when the actor fails otherwise, for new
    ones ActorCheckLost (their start reports why)."""

    def __init__(self, actor: Any, timeout_s: float, kept: bool):
        self.actor, self.timeout_s, self.kept = actor, timeout_s, kept
        self.data: tuple = ()

    @staticmethod
    def of(group: Any, cfg: Config) -> Optional["WarmCheck"]:
        if group is None or cfg.init:
            return None
        if not is_torchvision_model(cfg.model) or "torchvision" in sys.modules:
            return None
        kept = group.reused and group.starting is None
        # (new actors: their start's limit, then a call's)
        return WarmCheck(group.actors[0], call_timeout_s(cfg) + (0 if kept else cfg.max_wait), kept)

    @property
    def who(self) -> str:
        """startup.model_check's word for it."""
        return "kept actor" if self.kept else "actor"

    def with_data(self, num_classes: int, sample_shape: tuple[int, ...], data_channels: int) -> "WarmCheck":
        self.data = (num_classes, tuple(sample_shape), data_channels)
        return self

    def routing(self, cfg: Config, mesh: Mesh, check: bool = True) -> Routing:
        call = self.actor.check_model.remote(cfg.to_dict(), (mesh.dp, mesh.pp, mesh.fs), *self.data, check)
        try:
            return ray.get(call, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, (ConfigError, LayoutError)):
                raise e.cause from None
            raise ClusterError(f"the {self.who} checking --model {cfg.model} failed: {e.cause!r}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            if not self.kept:
                raise ActorCheckLost() from None
            raise ClusterError(f"the kept actor checking --model {cfg.model} was lost or stuck "
                               f"({type(e).__name__}): run again (new actors start)",
                               recoverable=True) from None


def check_before_ray(cfg: Config, resume: Optional[Checkpoint], warm: Optional[WarmCheck] = None
                     ) -> tuple[Source, Sharding, Any, Routing]:
    """The checks that need no cluster; returns (source, its train sharding (split over the mesh's dp when
    read), the whole model as one device runs it (or ``warm``, which checks and routes it in one of the run's
    actors), the routing for that ``dp``). Raises ConfigError / DataError / LayoutError / CheckpointError."""
    if is_user_model(cfg.model):
        resolve(cfg.model)  # the module and function found: raises ConfigError before the data is read
    elif warm is None and is_torchvision_model(cfg.model) and cfg.model not in model_names():
        # raises ConfigError naming --model, before the data is read (torchvision imported)
        build_model(cfg.model, 1)
    if cfg.dp is not None:
        memory_check(cfg)  # --max-memory-gib: refused before Ray starts
    source = check_source(cfg)   # (a set in a bucket: its manifest alone, no shard fetched here)
    sharding = Sharding(source.train_size, cfg.global_batch_size, cfg.seed, make_order(cfg, source),
                        val_split=cfg.val_split)
    sharding.val_indices()  # (raises ConfigError for a --val-split that holds out no image)
    check_schedule(cfg, sharding.steps_per_epoch)
    if resume is not None:
        check_steps_left(resume, total_steps(cfg, sharding.steps_per_epoch))
    mesh = Mesh(cfg.dp or 1, cfg.pp, cfg.fs)
    data = (source.num_classes, tuple(source.sample_shape), source.expanded_from or source.sample_shape[0])
    if warm is not None:
        try:
            reference, routing = warm.with_data(*data), warm.routing(cfg, mesh)
            # (the wait for the actor's imports, apart from the driver's own checks)
            startup.mark("model_checked")
        except ActorCheckLost:
            warm = None
    if warm is None:
        reference, routing = checked_routing(cfg, mesh, *data)
    remember(cfg)   # (the model's checks passed: the next run with these settings may start its actors first)
    clock = startup.current()
    if clock is not None:
        clock.model_check = "driver" if warm is None else warm.who
    if resume is not None:  # (a resumed run's --dp comes from its checkpoint)
        check_resumable(resume, cfg, routing.mesh, routing.stages, source.num_classes,
                        tuple(source.sample_shape))
    return source, sharding, reference, routing


def check_gpu_share(cfg: Config) -> None:
    """With ``--gpus-per-actor`` below 1 on GPUs: refuse, before any actor starts, a layout whose predicted
    peak memory per actor (``planner.memory``) exceeds that share of the GPU's total memory (measured by
    a task on one GPU of the cluster), as actors packed onto one GPU would run out of memory mid-run.
    Raises ConfigError."""
    if cfg.device != "cuda" or cfg.gpus_per_actor >= 1:
        return
    total = run_on_device(gpu_total_bytes, (), gpu=True, num_gpus=cfg.gpus_per_actor) / GIB
    problem = gpu_share_problem(predicted_peak_gib(cfg), cfg.gpus_per_actor, total)
    if problem:
        raise ConfigError(problem)


def with_data_on_device(cfg: Config, mesh: Mesh, source: Source, log=print) -> tuple[Config, Source]:
    """``cfg`` with ``--data-on-device auto`` resolved to on or off against the cluster (``data.small``'s
    rule: the memory each actor's copy shares, the node's among its CPU actors or a GPU's free memory),
    and the source to match; one console line says which and why (for ``on`` and ``off``: as given).
    Other data: unchanged."""
    if cfg.data not in ("imagefolder", "shards"):
        return cfg, source
    streamed = ("each batch read from the raw shards, no decode" if cfg.raw_pixels
                else "the loader decodes each batch")
    if cfg.data_on_device != "auto":
        chosen = "both splits held on the device" if cfg.data_on_device == "on" else streamed
        log(f"rayconv: --data-on-device {cfg.data_on_device}: {chosen} (as given)")
        return cfg, source
    data_bytes = held_bytes(cfg, source.train_size + source.test_size)
    if not is_held(source):   # the augmentation, or the size alone, rules it out
        why = (f"--augment {cfg.augmentation} needs each image's own size" if cfg.augmentation not in
               ("pad-crop", "none") else f"{data_bytes / 2**20:.1f} MB of decoded images > "
               f"{SMALL_DATA_BYTES / 2**30:g} GiB")
        held = False
    else:
        if cfg.device == "cuda":
            memory, actors, what = run_on_device(gpu_free_bytes, (), gpu=True, num_gpus=cfg.gpus_per_actor), \
                1, "a GPU's free memory"
        else:
            memory, actors = node_memory_share(ray.nodes(), mesh.world_size, cfg.num_cpus_per_actor)
            what = "the node's memory"
        held, why = decide_auto(data_bytes, memory, actors, what)
    chosen = "both splits held on the device" if held else streamed
    log(f"rayconv: --data-on-device auto: {chosen} ({why})")
    cfg = dataclasses.replace(cfg, data_on_device="on" if held else "off").validate()
    return cfg, source if held or not is_held(source) else check_source(cfg)


def resolve_routing(cfg: Config, mesh: Mesh, checked: Routing, reference, source: Source,
                 log=print) -> tuple[Config, Routing]:
    """The run's routing for the resolved ``mesh``: ``checked`` (the routing the settings were checked
    with before Ray) when the mesh is the same and the stages need no measuring, else built once more.

    With ``--balance time`` (or auto on GPUs) and no ``--stages``, the pipeline stages are balanced by
    measured layer times (on one device of the cluster, at the micro-batch size); the cut is written
    into the returned settings, so that a resumed run keeps it."""
    by_time = cfg.balance == "time" or (cfg.balance == "auto" and cfg.device == "cuda")
    if mesh.pp == 1 or cfg.stages or not by_time:
        if mesh == checked.mesh:
            return cfg, checked
        if isinstance(reference, WarmCheck):
            return cfg, reference.routing(cfg, mesh, check=False)
        return cfg, make_routing(cfg, mesh, reference, source.sample_shape)
    micro_batch = max(1, cfg.global_batch_size // mesh.dp // cfg.num_microbatches)
    costs = run_on_device(measured_costs, (cfg.to_dict(), micro_batch), gpu=cfg.device == "cuda",
                          model=cfg.model, num_gpus=cfg.gpus_per_actor)
    routing = make_routing(cfg, mesh, reference, source.sample_shape, costs=costs)
    log(f"pipeline stages balanced by measured forward+backward time per layer (ms, micro-batch "
        f"{micro_batch}): " + ", ".join(f"{sum(costs[a:b]):.2f}" for a, b in routing.stages))
    return dataclasses.replace(cfg, stages=",".join(str(a) for a, _ in routing.stages[1:])), routing


def check_steps_left(resume: Checkpoint, steps: int) -> None:
    """Refuse to resume a checkpoint that has no step left to train: at or past the run's ``steps``
    (``--steps``, else ``--epochs`` x steps per epoch). Raises CheckpointError."""
    if resume.step == steps:
        raise CheckpointError(f"--resume {resume.run_dir} is already at its last step ({resume.step} of "
                              f"{steps}): raise --steps (or --epochs) to continue it (nothing was written)")
    if resume.step > steps:
        raise CheckpointError(
            f"--resume {resume.path} is at step {resume.step}, past this run's last ({steps}): "
            f"give --steps above {resume.step} (or more --epochs) to continue it")


def call_timeout_s(cfg: Config) -> float:
    """Seconds one call to the actors may take before they are stopped: a collective fails after
    ``--collective-timeout-s`` inside the actors; this catches an actor stuck outside any collective."""
    return 2 * cfg.collective_timeout_s + 30

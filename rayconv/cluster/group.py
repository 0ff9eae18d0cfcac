"""The actors of one run: reserve a placement group, start the actors, call them, stop them.

Bootstrap follows Ray Train's: one placement-group bundle per actor (PACK, so that neighbouring ranks
share a node), actors ordered by (node, bundle) so that ranks of one node are contiguous and the
filter-split groups (innermost mesh axis) stay inside a node; rank 0 picks the rendezvous address and
every actor joins the torch.distributed process group at once. Run inside a placement group (a Ray
Tune trial's, whose resources are the run's bundles: ``rayconv.tune``), the actors take that group's
last bundles and leave the group to its owner. The actor class is the caller's
(``rayconv.actor.actor.Actor`` for a training run): this module only places and calls it. A user's
model (``--model MODULE:FUNCTION``) reaches the actors through their runtime environment
(``user_model.actor_runtime_env``: its modules, shipped through Ray's object store by ``cluster.ship``), on
every node. What each actor reserves, its runtime environment and roles are the run's ``ActorSpec``'s,
handed here as plain values; which actors a run gets (new ones from here, or kept ones, renewed here:
``ActorGroup.renew``) is ``cluster.acquire``'s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayconv.cluster import across, pool
from rayconv.cluster.calls import Method, Pending, is_collective_failure, is_lost
from rayconv.cluster.connect import NAMESPACE, actor_error, exception_summary
from rayconv.cluster.ship import modules
from rayconv.errors import CallTimeout, ClusterError, first_line

LOST_GRACE_S = 2.0  # after an actor error, how long to look for a lost actor that caused it
RENEW_S = 30.0  # how long kept actors may take to renew before new ones are started instead


@dataclass
class ActorGroup:
    """The started actors of one run, index = rank. As a context manager it kills them on exit."""

    actors: list[Any]
    roles: list[str]
    pg: Any
    info: list[dict[str, Any]]
    first_bundle: int = 0   # the actors' bundles are pg's first_bundle .. first_bundle + len(actors) - 1
    owns_pg: bool = True    # False: a placement group given to the run (a Tune trial's), not removed here
    # a start not waited for yet (``create_actors(wait=False)``): (their ``whereami`` call, the monotonic
    # deadline, the start-up limit to name); ``wait_started`` collects it into ``info``
    starting: Optional[tuple[Any, float, float]] = None
    key: str = ""   # what another run's actors must match to reuse these (``pool.actors_key``)
    reused: bool = False   # kept from a previous run (of this process: ``pool.take``; or ``across.claim``)
    names: list[str] = field(default_factory=list)   # the actors' names (namespace ``rayconv``), rank order
    across: bool = False   # kept on the cluster by a previous command (``across.claim``)
    # actors of this placement group the run does not use (a kept group larger than the run: ``rest_after``),
    # with their ``names`` and ``info``; they rejoin ``actors`` when the group is kept again (``hand_over``)
    spare: list[Any] = field(default_factory=list)
    spare_names: list[str] = field(default_factory=list)
    spare_info: list[dict[str, Any]] = field(default_factory=list)

    def call(self, method: Method, *args, ranks: Optional[Sequence[int]] = None,
             timeout_s: Optional[float] = None):
        """Call ``method(*args)`` (``Actor.<name>``) on the actors (all, or ``ranks``); results in rank
        order (see ``call_each``)."""
        ranks = list(range(len(self.actors))) if ranks is None else list(ranks)
        return self.call_each(method, [args] * len(ranks), ranks=ranks, timeout_s=timeout_s)

    def call_each(self, method: Method, args: Sequence[Sequence[Any]], ranks: Optional[Sequence[int]] = None,
                  timeout_s: Optional[float] = None) -> list[Any]:
        """Call ``method(*args[i])`` on actor ``ranks[i]`` (default: all, in rank order); return the results.

        If any actor raises, the others may be blocked in a collective: all actors are killed, an error names
        the actor's role and its own (``connect.actor_error``; no hang). Same after ``timeout_s``."""
        return self.collect(self.submit_each(method, args, ranks), timeout_s=timeout_s)

    def submit(self, method: Method, *args) -> "Pending":
        """Start ``method(*args)`` on every actor without waiting; ``collect`` gets the results.
        Calls to one actor run in submission order, so the next step can be queued while one runs."""
        return self.submit_each(method, [args] * len(self.actors))

    def submit_each(self, method: Method, args: Sequence[Sequence[Any]],
                    ranks: Optional[Sequence[int]] = None) -> "Pending":
        ranks, name = list(range(len(self.actors))) if ranks is None else list(ranks), method.__name__
        return Pending(name, ranks, [getattr(self.actors[r], name).remote(*a) for r, a in zip(ranks, args)])

    def collect(self, call: "Pending", timeout_s: Optional[float] = None) -> list[Any]:
        """Results of a submitted call in rank order; on failure as ``call_each`` says."""
        method, ranks, refs = call.method, call.ranks, call.refs
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                self.kill()
                raise CallTimeout(f"{method} did not finish within {timeout_s:g} s (a stuck actor or "
                                  "collective): actors stopped", recoverable=True)
            try:
                ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - re-raised with the actor's role
                r, err = ranks[refs.index(done[0])], e
                if not is_lost(e):
                    # A peer that died makes the others' collectives fail first: look briefly for a
                    # lost actor, whose loss is the cause worth reporting.
                    late, _ = ray.wait(pending, num_returns=len(pending), timeout=LOST_GRACE_S)
                    for ref in late:
                        try:
                            ray.get(ref)
                        except Exception as e2:  # noqa: BLE001
                            if is_lost(e2):
                                r, err = ranks[refs.index(ref)], e2
                                break
                self.kill()
                lost, summary = is_lost(err), exception_summary(err)
                what = "was lost (process or node died)" if lost else "failed"
                if lost:  # Ray's explanation runs over several lines; its first says it all
                    summary = summary.splitlines()[0]
                elif is_collective_failure(err) and "timed out" in summary.lower():
                    summary += ("; the collective waited past --collective-timeout-s: raise it if a peer is "
                                "only slow, not stuck")
                raise actor_error(f"actor {self.roles[r]} (rank {r}) {what} in {method}: {summary}", err,
                                  recoverable=lost or is_collective_failure(err)) from None
        return ray.get(refs)

    def wait_started(self) -> None:
        """Wait until the actors of a start not waited for (``create_actors(wait=False)``) run, and fill
        ``info``; nothing when there is none. Raises ClusterError past the start-up limit (the actors
        and the placement group are removed)."""
        if self.starting is None:
            return
        (call, deadline, limit_s), self.starting = self.starting, None
        try:
            self.info = self.collect(call, timeout_s=max(0.0, deadline - time.monotonic()))
        except CallTimeout:
            raise ClusterError(f"the {len(self.actors)} actors did not start within {limit_s:g} s "
                               "(--max-wait; their processes start and import torch, slowly on a loaded "
                               "machine): raise --max-wait") from None

    def renew(self, settings: dict[str, Any], run_name: str, roles: list[str]) -> bool:
        """Renew the actors of a kept group for the run ``run_name`` (``Actor.renew(settings, run_name,
        role)``, in rank order, within RENEW_S seconds, plus what is left of the start-up limit of actors
        still starting) and set its roles; False when one does not (gone, failed: the group is then
        stopped, ``collect`` kills it, and the run starts its own)."""
        left_s = 0.0 if self.starting is None else max(0.0, self.starting[1] - time.monotonic())
        try:
            renewing = self.submit_each(pool.KeptActor.renew, [(settings, run_name, r) for r in roles])
            self.collect(renewing, timeout_s=RENEW_S + left_s)
        except Exception as e:  # noqa: BLE001 - stopped (collect kills it): the run starts its own
            logging.getLogger("rayconv").info("kept actors did not renew (%s): starting new ones",
                                              exception_summary(e))
            self.kill()
            return False
        self.roles, self.reused = list(roles), True
        return True

    def __enter__(self) -> "ActorGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def rest_after(self, n: int) -> None:
        """Use the first ``n`` actors (rank order: the bundles first_bundle .. first_bundle + n - 1); the
        others ``rest`` (each drops its previous run's state) as ``spare``."""
        assert not self.spare and 0 < n <= len(self.actors)
        self.spare, self.spare_names, self.spare_info = self.actors[n:], self.names[n:], self.info[n:]
        self.actors, self.names, self.info = self.actors[:n], self.names[:n], self.info[:n]
        for a in self.spare:
            a.rest.remote()

    def hand_over(self) -> "ActorGroup":
        """A new ActorGroup holding these actors (the spare ones back among them, in rank order) and the
        placement group; this one is left empty (its ``kill`` does nothing): ``pool.keep``,
        ``across.keep``."""
        other = ActorGroup(self.actors + self.spare, self.roles, self.pg, self.info + self.spare_info,
                           self.first_bundle, self.owns_pg, starting=self.starting, key=self.key,
                           names=self.names + self.spare_names)
        self.actors, self.pg, self.owns_pg, self.starting = [], None, False, None
        self.spare, self.spare_names, self.spare_info = [], [], []
        return other

    def kill(self) -> None:
        """Stop every actor (the spare ones too) and release the placement group (safe to repeat)."""
        for a in self.actors + self.spare:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if not self.owns_pg:
            return
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


def reserve(bundle: dict[str, float], count: int, run_name: str, timeout_s: float) -> Any:
    """The run's placement group ``rayconv/<run>``, ``count`` bundles ``bundle`` (one per actor, PACK), ready
    within ``timeout_s`` seconds; detached where its actors may be kept on the cluster for the next
    command (``across``). Kept groups the free resources leave no room beside are the caller's to stop
    first (``pool.make_room``); those still in the way once it waits a moment are stopped here
    (``pool.release``, ``across.make_room``). Raises ClusterError (nothing stays reserved)."""
    across.sweep()   # (placement groups of commands that died before their actors existed)
    name = f"rayconv/{run_name}"
    deadline = time.monotonic() + timeout_s
    try:
        pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK", name=name,
                             lifetime="detached" if across.enabled() else None)
        across.pending(name)   # (until its actors exist and watch it: create_actors)
    except ray.exceptions.RayError as e:
        raise ClusterError(f"Ray refused the placement group of run {run_name}: {first_line(e)}") from None
    try:
        ready = pg.ready()
        if (pool.kept_group() is not None
                and not ray.wait([ready], timeout=min(timeout_s, across.KEPT_WAIT_S))[0]):
            pool.release()   # (kept groups that the free resources seemed to leave room beside: a node's)
        # actors kept on the cluster for another command hold resources: stopped when this one waits
        across.make_room(ready, timeout_s)
        ray.get(ready, timeout=max(0.0, deadline - time.monotonic()))
    except BaseException as e:
        ActorGroup([], [], pg, []).kill()  # removes the placement group
        across.created(name)
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise ClusterError(f"could not reserve {count} x {bundle} within {timeout_s:g} s "
                               "(--max-wait): the cluster is busy or too small; free resources, lower the "
                               "layout or raise --max-wait") from None
        if isinstance(e, ray.exceptions.RayError):
            raise ClusterError(
                f"Ray could not reserve resources for run {run_name}: {first_line(e)}") from None
        raise
    return pg


def create_actors(actor_cls: type, settings: dict[str, Any], roles: list[str], run_name: str, pg: Any,
                  timeout_s: float, *, bundle: dict[str, float], env: Optional[dict[str, Any]], key: str,
                  limit_s: Optional[float] = None, first_bundle: Optional[int] = None,
                  wait: bool = True) -> ActorGroup:
    """Start one ``actor_cls`` actor per role of ``roles`` (rank order), each in a bundle ``bundle`` of ``pg``
    (from ``first_bundle`` on, when given: a group this run does not own, left to its owner), in the
    runtime environment ``env``, and wait up to ``timeout_s`` seconds for them to run (part of the start-up
    limit ``limit_s``, named in the error; ``wait`` False: that wait is ``wait_started``'s).
    ``actor_cls(settings, run_name, role)`` makes an actor (with ``modules=``, the zip of a user's modules,
    where ``env`` ships some: ``ship.unpack``); it must have ``whereami()``. ``key``: what
    another run's actors must match to reuse these (``pool.actors_key``). Raises ClusterError; on failure
    the actors and ``pg`` are removed."""
    owns, first_bundle = first_bundle is None, first_bundle or 0
    deadline = time.monotonic() + timeout_s
    actors: list[Any] = []
    started: list[str] = []
    try:
        # Rank order: by node (in order of first appearance), then bundle index.
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        node_order: dict[str, int] = {}
        mine = range(first_bundle, first_bundle + len(roles))
        for b in mine:
            node_order.setdefault(nodes[b], len(node_order))
        bundles = sorted(mine, key=lambda b: (node_order[nodes[b]], b))
        remote = ray.remote(actor_cls)
        names = [f"rayconv/{run_name}/{role}" for role in roles]
        _wait_names_free(names, max(0.0, deadline - time.monotonic()))
        # (detached, each watching this driver, where they may be kept on the cluster: across)
        options, kwargs = across.actor_options() if owns else ({}, {})
        shipped = modules(env)   # (a user's modules: the actor unpacks them first, ``ship.unpack``)
        kwargs = {**kwargs, "modules": shipped} if shipped is not None else kwargs
        for rank, b in enumerate(bundles):
            actors.append(remote.options(
                name=names[rank], namespace=NAMESPACE, num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0), max_restarts=0, runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                **options,
            ).remote(settings, run_name, roles[rank], **kwargs))
            started.append(roles[rank])
    except BaseException as e:
        # Nothing stays reserved when the start fails (a busy cluster, a name in use, Ctrl-C).
        ActorGroup(actors, started, pg, [], first_bundle, owns).kill()
        if isinstance(e, ray.exceptions.RayError):
            raise ClusterError(f"Ray could not start the actors of run {run_name}: {first_line(e)}") from None
        raise
    finally:
        if owns:
            across.created(f"rayconv/{run_name}")
    actor_group = ActorGroup(actors, list(roles), pg, [], first_bundle, owns, names=names, key=key)
    actor_group.starting = (actor_group.submit(pool.KeptActor.whereami), deadline, limit_s or timeout_s)
    if wait:
        actor_group.wait_started()
    return actor_group


def _wait_names_free(names: list[str], timeout_s: float) -> None:
    """Wait until no live actor holds one of ``names`` (actors of a previous attempt of this run that
    were just killed release their names asynchronously)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"an actor named {name} is still alive after {timeout_s:g} s "
                                   "(--max-wait): the actors of a previous attempt of this run did not stop "
                                   "in time")
            time.sleep(0.2)

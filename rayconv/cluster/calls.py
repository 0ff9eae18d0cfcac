"""One call to a run's actors: the method named by a typed reference, the call under way, and what a
failed call was.

A caller names the actor's method by its class's function (``Actor.train_step``, or ``pool.KeptActor``'s
for the cluster layer's own calls), so a reader jumps to the definition; ``ActorGroup`` turns it into
Ray's ``handle.<name>.remote`` in one place. A failed call is a lost actor (its process or node died:
recoverable, a new one can take its place) or a failure inside ``torch.distributed`` (a peer vanished,
a collective timed out), or an error the actor raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ray

Method = Callable[..., Any]   # a function of the actor's class: ``Actor.train_step``


@dataclass
class Pending:
    """A call started on some actors: method name, ranks and their result references."""

    method: str
    ranks: list[int]
    refs: list[Any]

    def done(self) -> bool:
        """Whether every actor's call has returned (or raised), without waiting."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)


def is_lost(e: BaseException) -> bool:
    """An actor that is gone (process killed, node lost), rather than one that raised."""
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                          ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError))


def is_collective_failure(e: BaseException) -> bool:
    """A torch.distributed failure inside the actor: a peer vanished, a collective timed out."""
    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
    import torch.distributed as dist   # (the driver's torch, imported by then: a failed call came back)

    if isinstance(cause, getattr(dist, "DistError", ())):
        return True
    text = str(cause)
    return any(w in text for w in ("gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset"))

"""Every error a user can cause or an operator acts on, each a one-line message that says what to change.

``python -m rayconv.run`` (and ``.plan``, ``.prepare``, ``.bench``) prints the message and exits with
status 2; the module imports nothing, so that every layer can raise these.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting the user can change is invalid; the message says which flag and how."""


class ClusterError(RuntimeError):
    """The Ray cluster cannot run the layout (unreachable, too few devices, an actor failed).

    ``recoverable`` is True when restarting the actors may help: an actor process or its node was
    lost, a call timed out, or a collective failed (a peer vanished or hung); False for an error the
    actor's own code raised (bad data, a model that does not fit), which would happen again."""

    def __init__(self, msg: str, recoverable: bool = False):
        super().__init__(msg)
        self.recoverable = recoverable


class CallTimeout(ClusterError):
    """A call to the actors did not return within its limit (``ActorGroup.collect``); the actors were
    stopped."""


class RunStopped(KeyboardInterrupt):
    """The run's caller stopped it (a search's scheduler ending a trial early): handled as Ctrl-C is, the
    actors stopped and what the run wrote kept, its summary's ``status`` interrupted with ``stopped_by``
    this message."""


class TooFewDevices(ClusterError):
    """An --elastic run has had fewer devices than its --elastic minimum for --max-wait seconds; it
    stopped with its last checkpoint kept (``rayconv.run``: exit status 2 and the resume command)."""


class LayoutError(ValueError):
    """A layout cannot be applied to this model (too many stages, bad cut points, ...)."""


class ScheduleError(ValueError):
    """A schedule is malformed (missing/duplicate/misordered actions) or deadlocks."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used (missing, incomplete, corrupt, another model or layout)."""


class DataError(ValueError):
    """The data cannot be read (missing folder, empty class list, a file that does not decode)."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (the error's type name where it has none), without the
    ``System error: `` prefix Ray puts before a system error's message: what a one-line error says of
    an error it passes on."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[0].removeprefix("System error: ")

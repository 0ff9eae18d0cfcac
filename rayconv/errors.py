"""``ConfigError``: the error a user fixes by changing a setting.

Raised by the settings (``config.py``), checkpoints (``CheckpointError``), models, data and the cluster
check; ``python -m rayconv.run`` prints its one-line message and exits with status 2. It lives in a module
of its own, importing nothing, so that every module can raise it: ``config`` imports ``checkpoint`` (to
read the settings ``--resume`` names), and ``checkpoint`` raises it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting the user can change is invalid; the message says which flag and how."""

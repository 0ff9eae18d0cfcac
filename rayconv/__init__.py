"""rayconv: multi-GPU ConvNet training on Ray actors (data parallel, pipeline stages, filter split).

Reproduces Yadan, Adams, Taigman and Ranzato, "Multi-GPU Training of ConvNets" (2013). Entry points:
``python -m rayconv.run`` (training) and ``rayconv.fit(config=None, **settings)`` (``rayconv.api``:
the same settings and checks from Python; returns the summary; ``release_actors()`` stops the
actors it keeps for the next ``fit``) and ``whole_state(path)`` (a checkpoint's whole state, from a folder
or a bucket, without Ray: ``rayconv.outputs.checkpoint.whole_state``).
"""

import time as _time

IMPORTED = _time.monotonic()  # (the start-up clock's origin where the process ran other commands first)

from rayconv.api import fit, release_actors  # noqa: E402
from rayconv.config import Config  # noqa: E402
from rayconv.errors import ConfigError  # noqa: E402
from rayconv.outputs.checkpoint import whole_state  # noqa: E402

__all__ = ["Config", "ConfigError", "fit", "release_actors", "whole_state", "__version__"]
__version__ = "0.1.0"


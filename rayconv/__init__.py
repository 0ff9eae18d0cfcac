"""rayconv: multi-GPU ConvNet training on Ray actors (data parallel, pipeline stages, filter split).

Reproduces Yadan, Adams, Taigman and Ranzato, "Multi-GPU Training of ConvNets" (2013). Entry points:
``python -m rayconv.run`` (training) and ``rayconv.fit(config=None, **settings)`` (``rayconv.api``:
the same settings and checks from Python; returns the summary).
"""

from rayconv.api import fit
from rayconv.config import Config
from rayconv.errors import ConfigError

__all__ = ["Config", "ConfigError", "fit", "__version__"]
__version__ = "0.1.0"

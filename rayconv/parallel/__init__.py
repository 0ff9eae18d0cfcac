"""The parallel training machinery: collectives (``comm``), the layout plan every actor cuts its part
from (``layout_plan``), ``parallelize`` (cut, filter split or per-layer plan, batch-norm mode,
data-parallel sync, in that order), data parallel (``data_parallel``), batch norm across micro-batches
(``batchnorm``), compiled segments (``part``), ``pipeline/`` and ``filter_split/``."""

"""The parallel training machinery: collectives (``comm``), the routing every actor cuts its part
from (``routing``), ``parallelize`` (cut, filter split or per-layer plan, batch-norm mode,
data-parallel sync, in that order), batch norm across micro-batches (``batchnorm``), compiled segments
(``segments``), and one package per parallelism: ``data_parallel/``, ``pipeline/`` (its schedule checks in
``pipeline/checks.py``) and ``filter_split/``."""

"""What a run writes: checkpoints (``checkpoint``; any layout's rank files joined and cut again by
``reshard``), the plain-PyTorch ``model.pt`` (``export``), ``metrics.parquet`` and the actors' Ray gauges
(``metrics``), TensorBoard's event files (``tensorboard``), the error-against-time chart (``charts``)."""

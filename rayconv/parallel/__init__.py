"""The parallel training machinery: collectives (``comm``), data parallel, pipeline, filter split, the per-actor part (``layout_plan``, ``part``) and batch norm across micro-batches."""

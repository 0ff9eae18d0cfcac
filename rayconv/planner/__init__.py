"""Choosing the layout: the cost model of a step (``costmodel``) with its parts (``profile``: the model's
per-layer facts; ``links``: transfer speeds and the machines' link table; ``buckets``: the data-parallel
gradient buckets; ``memory``: peak memory per actor), the measurements it runs on (``measure``) and the
ranking of layouts (``search``)."""

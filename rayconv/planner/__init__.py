"""Choosing the layout: the cost model (``costmodel``), the measurements it runs on (``measure``) and the ranking of layouts (``search``)."""

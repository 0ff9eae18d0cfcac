"""``python -m rayconv.bench``: the paper's experiments. The command line (``__main__``), measuring one
layout (``measure``), the loops over layouts: the layout table, the batch and memory sweeps and the
training curve (``sweeps``), the rows as files (``table``), and the plain-PyTorch and torchrun DDP
anchors (``anchor``, also ``python -m rayconv.bench.anchor``)."""

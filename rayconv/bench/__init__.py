"""``python -m rayconv.bench``: the paper's experiments (``measure``) and the plain-PyTorch anchor (``anchor``)."""

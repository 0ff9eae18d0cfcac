"""A small ConvNet for the default data (8x8 digit scans) and for fast CPU tests."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


class ConvNet(nn.Sequential):
    """conv(32)-relu-conv(64)-relu-maxpool-conv(64)-relu-avgpool(2x2)-fc(128)-relu-fc(num_classes).

    Input ``x_NCHW`` with C = ``in_channels`` and any H, W >= 2; output logits (N, num_classes).
    With ``batch_norm=True`` a BatchNorm2d follows each convolution. With ``columns=2``, conv2 connects
    each half of its input channels only to the same half of its filters (``groups=2``), Krizhevsky
    et al. 2012's two-column pattern (section 3.2): under ``--fs 2`` that layer needs no exchange.
    0.1 M parameters for 10 classes.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, batch_norm: bool = False, width: int = 32,
                 columns: int = 1):
        w = width
        layers: list[tuple[str, nn.Module]] = []

        def conv(name: str, cin: int, cout: int, groups: int = 1) -> None:
            layers.append((name, nn.Conv2d(cin, cout, 3, padding=1, groups=groups)))
            if batch_norm:
                layers.append((name + "_bn", nn.BatchNorm2d(cout)))
            layers.append((name + "_relu", nn.ReLU()))

        conv("conv1", in_channels, w)
        conv("conv2", w, 2 * w, groups=columns)
        layers.append(("pool", nn.MaxPool2d(2)))
        conv("conv3", 2 * w, 2 * w)
        layers += [("avgpool", nn.AdaptiveAvgPool2d(2)), ("flatten", nn.Flatten(1)),
                   ("fc1", nn.Linear(2 * w * 4, 4 * w)), ("fc1_relu", nn.ReLU()),
                   ("fc2", nn.Linear(4 * w, num_classes))]
        super().__init__(OrderedDict(layers))

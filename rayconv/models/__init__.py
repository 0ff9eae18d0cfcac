"""Models: a small test ConvNet, Krizhevsky's AlexNet and any torchvision classification ConvNet.

``build_model`` returns an unchanged ``nn.Module`` whose ``state_dict`` is what the model's own builder
loads (``torchvision.models.get_model(name, num_classes=K)`` or ``rayconv.models.ConvNet``).
``to_layers`` views that model as the flat sequence of layers its forward runs, which is what the
pipeline cuts into stages and the filter split divides; the layers are the model's own modules, so the
flat view and the model share parameters.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from rayconv.choices import FIXED_SIZE_DATA
from rayconv.config import ConfigError
from rayconv.models.channels import channel_mismatch, dry_forward
from rayconv.models.convnet import ConvNet
from rayconv.models.traced import NotCuttable, traced_layers
from rayconv.models.weights import load_init
from rayconv.model_names import RAYCONV_MODELS, remember, unknown_model
from rayconv.user_model import build_user_model, is_user_model

__all__ = ["ConvNet", "build_model", "check_trainable", "to_layers", "model_names"]


def _torchvision():
    """torchvision, imported on first use: importing it imports torch._dynamo (seconds of CPU), which
    every actor of a run of rayconv's own models on its own data would pay at start for nothing."""
    import torchvision

    return torchvision


def model_names() -> list[str]:
    """Names accepted by --model: convnet plus torchvision's classification models."""
    tv = _torchvision()
    listed = sorted(tv.models.list_models(module=tv.models))
    remember(listed)   # (for the driver's check before Ray: rayconv.model_names.check_known)
    return list(RAYCONV_MODELS) + listed


def build_model(name: str, num_classes: int, in_channels: int = 3, image_size: int = 224,
                batch_norm: bool = False, zero_init_residual: bool = False,
                data: Optional[str] = None) -> nn.Module:
    """A freshly initialised model (weights from the current torch RNG state).

    ``alexnet`` is torchvision's single-column AlexNet (Krizhevsky et al. 2012 / "One weird trick" 2014);
    ``googlenet`` and ``inception_v3`` are built without auxiliary classifiers (``BUILD_ARGS``).
    rayconv's convnets take any channel count and images of 2 pixels and more; a torchvision model below
    32 pixels is tried by a dry forward (``check_trainable``; ``data``: the --data name, for its advice) and
    refused where it fails.
    ``zero_init_residual`` is torchvision's (the last batch norm of each residual block starts at 0;
    Goyal et al. 2017, section 5.1), for builders that take it (ResNets, ResNeXts, wide ResNets).
    A user's model (``MODULE:FUNCTION``, ``path/to/file.py:FUNCTION``, a callable given to
    ``rayconv.fit``) is built by its own function (``rayconv.user_model``).
    Raises ConfigError for unknown names, for models that cannot take the data's image shape and for
    ``zero_init_residual`` on a model without it."""
    if is_user_model(name):
        if zero_init_residual:
            raise ConfigError(f"--zero-init-residual is torchvision's builder argument: --model {name} is "
                              "initialised by its own function; drop the flag")
        return build_user_model(name, num_classes, in_channels, image_size)
    if name in RAYCONV_MODELS:
        if zero_init_residual:
            raise ConfigError("--zero-init-residual applies to residual models (torchvision's resnet18, "
                              f"...): --model {name} has no residual blocks; drop the flag")
        if name == "alexnet2012":
            if in_channels != 3 or image_size < 63:
                raise ConfigError("--model alexnet2012 needs 3-channel images of at least 63x63 pixels: "
                                  "use --data synthetic or imagefolder")
            return alexnet_two_column(num_classes)
        return ConvNet(in_channels=in_channels, num_classes=num_classes,
                       batch_norm=batch_norm or name == "convnet_bn",
                       columns=2 if name == "convnet2col" else 1)
    names = model_names()
    if name not in names:
        raise unknown_model(name, names)
    if in_channels != 3:
        raise ConfigError(
            f"--model {name} takes 3-channel images but gets {in_channels} channel(s): drop "
            "--channels (grey --data is then given as 3 equal channels), or use --model convnet")
    args = dict(BUILD_ARGS.get(name, {}), **({"zero_init_residual": True} if zero_init_residual else {}))
    try:
        model = _torchvision().models.get_model(name, weights=None, num_classes=num_classes, **args)
    except TypeError as e:
        if zero_init_residual and "zero_init_residual" in str(e):
            raise ConfigError(f"--zero-init-residual: torchvision's {name} builder does not take it "
                              "(ResNets, ResNeXts and wide ResNets do): drop the flag") from None
        raise
    if image_size < 32:  # (torchvision's models are made for 224: below 32 many reduce the image to nothing)
        check_trainable(name, model, (in_channels, image_size, image_size), data=data)
    return model


# GoogLeNet and Inception v3 are built without their auxiliary classifiers: with them, their training
# forward returns a tuple of logits (GoogLeNetOutputs, InceptionOutputs) whose weighting in the loss is
# the training recipe's (0.3 in Szegedy et al. 2015, section 5; 0.4 in TF-slim's Inception v3), not
# the model's, and Inception v3's auxiliary head needs 299x299 images. torchvision evaluates both
# without the heads. ``init_weights=True`` is torchvision's default, given to keep it from warning.
BUILD_ARGS = {"googlenet": {"aux_logits": False, "init_weights": True},
              "inception_v3": {"aux_logits": False, "init_weights": True}}


def check_trainable(name: str, model: nn.Module, sample_shape: tuple[int, ...],
                    data_channels: Optional[int] = None, data: Optional[str] = None) -> tuple[int, ...]:
    """Refuse, before any actor starts, a model whose training forward does not map a batch of
    ``sample_shape`` images (C, H, W) to one tensor of class scores (batch, classes): one that returns
    a tuple or dict, or cannot take images of that size (vision transformers are made for one size).

    The forward runs in training mode on the meta device (shapes only: no memory, no compute, the
    model's own tensors untouched), falling back to a CPU forward for an operation meta tensors lack
    or a value the forward reads (data-dependent control flow); a small model (``cheap_on_cpu``) runs
    it on the CPU at once: the meta device's first use imports torch._dynamo (seconds, in the driver
    at every run's start). A forward that fails where the model's
    first convolution takes another channel count than ``sample_shape``'s is refused as that mismatch
    (``channels.channel_mismatch``; ``data_channels``: the data's own count, before grey is repeated).
    The advice for a size it cannot take names one it can (224) where the data are resized (``data``:
    the --data name; ``FIXED_SIZE_DATA`` are not: then other data or a model for small images).
    Returns the output's shape, (2, classes). Raises ConfigError naming --model and what to change."""
    lazy = sorted({type(m).__name__ for m in model.modules()
                   if isinstance(m, nn.modules.lazy.LazyModuleMixin)})
    if lazy:
        raise ConfigError(f"--model {name} has lazy modules ({', '.join(lazy)}), whose parameters a first "
                          "forward makes: give their sizes (nn.Linear(in_features, ...)), or call the model "
                          "once on a batch of the run's image size inside the function before returning it")

    def attempt(shape: tuple[int, ...]):
        if cheap_on_cpu(model, shape):
            return dry_forward(model, shape, "cpu")
        try:
            return dry_forward(model, shape, "meta")
        except NotImplementedError:
            return dry_forward(model, shape, "cpu")
        except RuntimeError as e:  # (a forward that reads a value, ``if x.mean() > 0``, needs real data)
            if "meta" not in str(e):
                raise
            return dry_forward(model, shape, "cpu")

    try:
        out = attempt(tuple(sample_shape))
    except (RuntimeError, AssertionError, ValueError, IndexError) as e:
        mismatch = channel_mismatch(name, model, tuple(sample_shape), data_channels)
        if mismatch:
            raise ConfigError(mismatch) from None
        what = (str(e).strip().splitlines() or [type(e).__name__])[0]
        size = "x".join(str(d) for d in sample_shape[1:])
        fixed = data in FIXED_SIZE_DATA
        fix = (f"--data {data} is never resized: pick a model for small images (convnet, convnet_bn)" if fixed
               else "pick another --image-size or --model")
        if tuple(sample_shape[1:]) != (224, 224):
            try:
                attempt((sample_shape[0], 224, 224))
                fix = (f"{fix}, or data --image-size resizes (e.g. --data fashion-mnist --image-size 224)"
                       if fixed else "use --image-size 224, a size it takes")
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
        raise ConfigError(f"--model {name} cannot take {size} images ({what}): {fix}") from None
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"--model {name} returns {type(out).__name__} when training, not a tensor of class "
                          "scores: rayconv trains models whose forward returns the logits; pick another "
                          "--model")
    if out.dim() != 2 or out.shape[0] != 2:
        raise ConfigError(f"--model {name} maps 2 images to a tensor of shape {tuple(out.shape)}, not (2, "
                          "classes): pick another --model")
    return tuple(out.shape)


CPU_CHECK_MAX = 2**30  # parameters x image pixels up to which check_trainable's forward runs on the CPU


def cheap_on_cpu(model: nn.Module, shape: tuple[int, ...]) -> bool:
    """Whether a CPU forward of ``model`` on 2 images of ``shape`` (C, H, W) is cheap: parameters x pixels
    at most ``CPU_CHECK_MAX``, which bounds a ConvNet's multiply-adds per image (each weight is applied at
    most once per input pixel): rayconv's ConvNet up to about 100 px, no torchvision model."""
    return sum(p.numel() for p in model.parameters()) * math.prod(shape[1:]) <= CPU_CHECK_MAX


def run_model(cfg, source, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The run's full model as every process builds it, identical everywhere: torch's RNG seeded with
    ``cfg.seed``, then ``build_model`` for ``source``'s classes and image shape (``source`` a
    ``rayconv.data.Source``), then in ``dtype`` when given (an actor's parameter dtype), its weights
    then replaced by ``--init``'s (``models.weights``) in that dtype: float64 weights enter a float64
    run exactly, not rounded through the float32 model as built. Raises what ``build_model`` and
    ``load_init`` raise."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.num_classes, source.sample_shape[0], source.sample_shape[1],
                        zero_init_residual=cfg.zero_init_residual, data=cfg.data)
    if cfg.bn_momentum is not None:
        set_bn_momentum(model, cfg.bn_momentum)
    if dtype is not None:
        model.to(dtype)
    if cfg.init:
        load_init(model, cfg.init, cfg.init_skip_head)
    return model


def set_bn_momentum(model: nn.Module, momentum: float) -> int:
    """Give every batch norm of ``model`` (``_BatchNorm``: 1-3 d, Sync) the running-statistics momentum
    ``momentum`` (--bn-momentum): each training forward moves the running mean and variance by
    ``momentum`` towards the batch's. Layouts copy it with the layer (filter-split, deferred, Sync).
    Returns how many layers were set."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    for m in layers:
        m.momentum = momentum
    return len(layers)


def alexnet_two_column(num_classes: int = 1000) -> nn.Module:
    """torchvision's AlexNet with Krizhevsky et al. 2012's column structure (section 3.5, figure 2):
    conv2, conv4 and conv5 connect only within a column (``groups=2``); conv3 and the fully connected
    layers connect across. Load its state_dict with ``rayconv.models.alexnet_two_column(K)``."""
    model = _torchvision().models.alexnet(weights=None, num_classes=num_classes)
    for i in (3, 8, 10):
        old = model.features[i]
        model.features[i] = nn.Conv2d(old.in_channels, old.out_channels, old.kernel_size, old.stride,
                                      old.padding, groups=2)
    return model


def to_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The flat sequence of (qualified name, module) that ``model.forward`` applies in order.

    rayconv's ConvNet and any ``nn.Sequential``: its children. MobileNet v2/v3 and EfficientNet:
    ``features``' children, avgpool, flatten, ``classifier``'s children (their traced graphs cut
    inside blocks, and EfficientNet's reads ``self.training``). Any other model, ResNets, AlexNet
    and VGG among them (whose traced view is these families' block list): the pieces between the
    points of its torch.fx graph where exactly one tensor is live (``traced.traced_layers``). A model
    fx cannot cut is one unsplittable layer: it trains data parallel but cannot be cut or split
    (``traced.cut_problem`` says why). The equality of ``run_layers`` on the flat view and
    ``model(x)`` is checked in tests/unit/test_models.py and tests/unit/test_traced.py.
    """
    if isinstance(model, nn.Sequential):
        return [(n, m) for n, m in model.named_children()]
    if all(hasattr(model, a) for a in ("features", "avgpool", "classifier")) \
            and isinstance(model.features, nn.Sequential) and type(model).forward in _features_forward():
        out = [(f"features.{n}", m) for n, m in model.features.named_children()]
        out += [("avgpool", model.avgpool), ("flatten", nn.Flatten(1))]
        cls = model.classifier
        out += [(f"classifier.{n}", m) for n, m in cls.named_children()] if isinstance(cls, nn.Sequential) \
            else [("classifier", cls)]
        return out
    try:
        return traced_layers(model)
    except NotCuttable:
        return [("", model)]


@functools.cache
def _features_forward() -> frozenset:
    """The forwards of models that run exactly features -> avgpool -> flatten(1) -> classifier and
    keep the hand-written view (AlexNet and VGG run so too; their traced view is the same)."""
    m = _torchvision().models
    return frozenset({m.MobileNetV2.forward, m.MobileNetV3.forward, m.EfficientNet.forward})


def run_layers(layers: list[tuple[str, nn.Module]], x: torch.Tensor) -> torch.Tensor:
    """``x`` through ``layers`` in order (``to_layers``' view of a model: equals the model's forward)."""
    for _, m in layers:
        x = m(x)
    return x

"""``--auto-augment POLICY``: torchvision's learned and random augmentation policies, as its reference
classification script names them: ``imagenet``, ``cifar10``, ``svhn`` (AutoAugment, Cubuk et al. 2019),
``ra`` (RandAugment, Cubuk et al. 2020), ``ta_wide`` (TrivialAugmentWide, Müller and Hutter 2021), each
``torchvision.transforms.v2``'s own transform with bilinear interpolation, applied to uint8 images after
the crop and flip and before the normalisation (the reference script's order).

Batched on the device (``apply``): each training sample falls, per epoch, into one of ``GROUPS`` groups
drawn from (seed, epoch, index) (a per-epoch table, ``group_params``, or a hash, ``sample_groups``); the
transform runs once per group on the group's images, its random choice (sub-policy, magnitudes, signs) drawn
from ``stable_seed(seed, "auto-augment", epoch, group)`` in a forked RNG. A sample's augmentation therefore
depends on (seed, epoch, index) and its own pixels alone, not on the batch, the layout or the device; the
transforms' per-image operations (equalize, autocontrast, posterize, affine warps) treat each image of a group
on its own. What differs from a per-image draw: the samples of one group share their draw within the epoch (a
batch of B holds about ``min(B, GROUPS)`` independent draws), at the cost of ``GROUPS`` transform calls per
batch rather than B.
"""

from __future__ import annotations

import torch

from rayconv.data.source import stable_seed

POLICIES = ("imagenet", "cifar10", "svhn", "ra", "ta_wide")
GROUPS = 64


def make_transform(policy: str):
    """torchvision v2's transform for ``policy`` (one of POLICIES), bilinear. Raises ValueError for
    another."""
    from torchvision.transforms import v2 as T   # (torchvision's import takes seconds: only when used)

    bilinear = T.InterpolationMode.BILINEAR
    if policy == "ra":
        return T.RandAugment(interpolation=bilinear)
    if policy == "ta_wide":
        return T.TrivialAugmentWide(interpolation=bilinear)
    if policy in ("imagenet", "cifar10", "svhn"):
        return T.AutoAugment(T.AutoAugmentPolicy(policy), interpolation=bilinear)
    raise ValueError(f"unknown --auto-augment {policy!r}: choose one of {', '.join(POLICIES)}")


def group_params(n: int, generator: torch.Generator) -> torch.Tensor:
    """Each of n samples' group (n,) int64 in [0, GROUPS), drawn from ``generator``."""
    return torch.randint(0, GROUPS, (n,), generator=generator, device=generator.device)


def sample_groups(seed: int, epoch: int, idx) -> torch.Tensor:
    """The groups (len(idx),) int64 of samples ``idx`` in ``epoch``, each from (seed, epoch, index) alone
    (for sources that draw no per-epoch table)."""
    return torch.tensor([stable_seed(seed, "auto-augment-group", epoch, int(i)) % GROUPS for i in idx],
                        dtype=torch.int64)


def apply(x: torch.Tensor, groups: torch.Tensor, transform, seed: int, epoch: int) -> torch.Tensor:
    """x (N, C, H, W) uint8 -> (N, C, H, W) uint8: the images of each group in ``groups`` (N,) int64 (on
    x's device) through ``transform`` once, its random draw seeded by (``seed``, epoch, group); the
    global RNG is left as it was."""
    out = torch.empty_like(x)
    for g in torch.unique(groups).tolist():
        rows = (groups == g).nonzero().squeeze(1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stable_seed(seed, "auto-augment", epoch, int(g)))
            out[rows] = transform(x[rows])
    return out

"""Tests for rayconv.recipe.mix (no Ray): the mix of a sample does not depend on how the global batch is
split, and the pixel and label arithmetic is torchvision's transforms.v2 MixUp / CutMix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from rayconv.errors import ConfigError
from rayconv.recipe.loss import cross_entropy
from rayconv.recipe.mix import MixDraw, cutmix_box, draw_mix, mix_images, mix_targets, partner_positions

B, K, HW = 8, 5, (7, 6)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, *HW, generator=g, dtype=torch.float64), torch.randint(0, K, (B,), generator=g)


def _mix_in_pieces(draw: MixDraw, images, labels, pieces: list[np.ndarray]):
    """Each piece mixes its own positions, reading its partners' samples; results put back in place."""
    out_x, out_y = torch.empty_like(images), torch.empty(B, K, dtype=torch.float64)
    for pos in pieces:
        partner = partner_positions(draw, pos)
        out_x[pos] = mix_images(draw, images[pos], images[partner])
        out_y[pos] = mix_targets(draw, labels[pos], labels[partner], K, torch.float64)
    return out_x, out_y


@pytest.mark.parametrize("alphas", [(0.2, 0.0), (0.0, 1.0), (0.8, 1.0)])
@pytest.mark.parametrize("step", [0, 3, 17])
def test_mix_does_not_depend_on_the_split_of_the_global_batch(alphas, step: int) -> None:
    images, labels = _batch(step)
    draw = draw_mix(7, step, B, *alphas, image_size=HW)
    want_x, want_y = _mix_in_pieces(draw, images, labels, [np.arange(B)])
    for n in (2, 4):
        for pieces in (np.array_split(np.arange(B), n),            # micro-batches
                       [np.arange(r, B, n) for r in range(n)]):    # strided replicas
            got_x, got_y = _mix_in_pieces(draw, images, labels, pieces)
            assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)
    assert not torch.equal(want_x, images)  # something was mixed
    assert torch.allclose(want_y.sum(1), torch.ones(B, dtype=torch.float64), rtol=1e-15)
    assert 0.0 < draw.lam < 1.0


def test_draws_are_a_function_of_seed_and_step() -> None:
    a, b = draw_mix(1, 5, B, 0.2, 1.0, HW), draw_mix(1, 5, B, 0.2, 1.0, HW)
    assert a.kind == b.kind and a.lam == b.lam and a.box == b.box and np.array_equal(a.partner, b.partner)
    assert sorted(a.partner.tolist()) == list(range(B))
    others = [draw_mix(s, t, B, 0.2, 1.0, HW) for s, t in [(2, 5), (1, 6)]]
    assert all(o.lam != a.lam for o in others)
    kinds = [draw_mix(0, t, B, 0.2, 1.0, HW).kind for t in range(400)]
    assert 150 < kinds.count("mixup") < 250 and kinds.count("mixup") + kinds.count("cutmix") == 400
    assert {draw_mix(0, t, B, 0.2, 0.0).kind for t in range(20)} == {"mixup"}
    assert {draw_mix(0, t, B, 0.0, 1.0, HW).kind for t in range(20)} == {"cutmix"}
    lams = [draw_mix(0, t, B, 1.0).lam for t in range(2000)]  # Beta(1, 1) is uniform
    assert abs(np.mean(lams) - 0.5) < 0.03 and abs(np.var(lams) - 1 / 12) < 0.01


def _rolled(draw_kind: str, lam: float, box=None) -> MixDraw:
    """torchvision's pairing: each sample mixes with the previous one (``roll(1, 0)``)."""
    return MixDraw(draw_kind, lam, (np.arange(B) - 1) % B, box)


def test_mixup_is_torchvisions_mixup() -> None:
    images, labels = _batch(1)
    t = v2.MixUp(alpha=0.4, num_classes=K)
    torch.manual_seed(11)
    params = {"labels": labels, "batch_size": B, **t.make_params([images])}
    draw = _rolled("mixup", params["lam"])
    pos = np.arange(B)
    assert torch.equal(mix_images(draw, images, images[partner_positions(draw, pos)]),
                       t.transform(images, params))
    want_y = t.transform(labels, params)
    got_y = mix_targets(draw, labels, labels[partner_positions(draw, pos)], K)
    assert got_y.dtype == want_y.dtype == torch.float32 and torch.equal(got_y, want_y)


@pytest.mark.parametrize("seed", range(6))
def test_cutmix_is_torchvisions_cutmix(seed: int) -> None:
    images, labels = _batch(seed)
    t = v2.CutMix(alpha=1.0, num_classes=K)
    torch.manual_seed(seed)
    params = {"labels": labels, "batch_size": B, **t.make_params([images])}
    torch.manual_seed(seed)  # the same draws, by hand: lam, then the box centre
    lam = float(t._dist.sample(()))
    r_x, r_y = int(torch.randint(HW[1], size=(1,))), int(torch.randint(HW[0], size=(1,)))
    box, lam_adjusted = cutmix_box(lam, r_x, r_y, *HW)
    assert (box, lam_adjusted) == (params["box"], params["lam_adjusted"])
    draw = _rolled("cutmix", lam_adjusted, box)
    partner = partner_positions(draw, np.arange(B))
    assert torch.equal(mix_images(draw, images, images[partner]), t.transform(images, params))
    assert torch.equal(mix_targets(draw, labels, labels[partner], K), t.transform(labels, params))


def test_mixed_targets_make_the_mixed_loss() -> None:
    images, labels = _batch(2)
    draw = draw_mix(3, 0, B, 0.4)
    partner = partner_positions(draw, np.arange(B))
    logits = images.flatten(1)[:, :K]
    soft = mix_targets(draw, labels, labels[partner], K, torch.float64)
    want = draw.lam * cross_entropy(logits, labels, 0.1) + (1 - draw.lam) * cross_entropy(logits,
                                                                                          labels[partner],
                                                                                          0.1)
    assert torch.allclose(cross_entropy(logits, soft, 0.1), want, rtol=1e-14)


def test_mix_refusals_and_off() -> None:
    assert draw_mix(0, 0, B) is None
    with pytest.raises(ConfigError, match="image size"):
        draw_mix(0, 0, B, cutmix_alpha=1.0)
    with pytest.raises(ConfigError, match="alpha"):
        draw_mix(0, 0, B, mixup_alpha=-0.1)
    draw = draw_mix(0, 0, B, 0.2)
    with pytest.raises(ValueError, match="global batch"):
        partner_positions(draw, np.array([B]))
    labels = torch.zeros(2, K)
    mix_targets(draw, labels, labels, K)
    assert torch.equal(labels, torch.zeros(2, K))  # probability targets are not changed in place

"""The sensitivity survives the secure sum's fixed-point encoding.

Rounding each of d coordinates to the nearest multiple of 2^-f can add √d·2^-(f+1) to a clipped
update's norm. With ``ClipPolicy.reserve_encoding(f)`` (the round engine calls it) the ENCODED
update has L2 norm ≤ C:

- a hypothesis property over random group shapes, policies, scales (clipping binding or not),
  weights and fractional bits;
- a constructed update the unreserved policy lets through at norm < C whose encoding rounds
  every coordinate up past C (the bug is real), and the reserved policy keeps ≤ C;
- too few fractional bits for the model size are refused naming the config key (8 bits for a
  million parameters would add up to 1.95 at C = 1);
- the EMA statistic's bound survives encoding too; quantile indicators and diagnostics lie on the
  grid or round within their range.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cluster_fl.config import ConfigError
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy import make_policy
from cluster_fl.privacy.clipping import ENCODING_SHARE, encoding_margin
from cluster_fl.secure_sum import decode, encode
from privacy_helpers import privacy

COMPONENTS = ("encoder", "connector", "decoder")


def encoded_norm(update: dict[str, torch.Tensor], bits: int) -> float:
    return math.sqrt(math.fsum(float(decode(encode(t, bits), bits).pow(2).sum())
                               for t in update.values()))


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 6))
    groups = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        comp = COMPONENTS[i % 3] if i < 3 else draw(st.sampled_from(COMPONENTS))
        groups.append(GroupSpec(f"g{i}", comp, math.prod(shape), shape))
    return groups


@settings(max_examples=120, deadline=None)
@given(layouts(), st.sampled_from(["flat", "uniform", "size", "alpha-split", "pools"]),
       st.floats(0.05, 4.0), st.floats(1e-3, 1e3), st.integers(12, 40), st.integers(0, 2**31),
       st.floats(0.05, 1.0))
def test_the_encoded_clipped_update_has_norm_at_most_c(groups, method, clip_norm, scale, bits,
                                                       seed, weight):
    assume(encoding_margin(sum(g.numel for g in groups), bits) <= ENCODING_SHARE * clip_norm)
    policy = make_policy(privacy(clipping=method, clip_norm=clip_norm, alpha=0.3), groups)
    policy.reserve_encoding(bits)
    gen = torch.Generator().manual_seed(seed)
    update = {g.name: torch.randn(g.shape, generator=gen) * scale for g in groups}
    clipped = policy.clip(update).update
    assert encoded_norm(clipped, bits) <= clip_norm
    # sample weighting (w <= 1) scales before the encoding: still within C
    assert encoded_norm({k: v * weight for k, v in clipped.items()}, bits) <= clip_norm


def _tie_update(d: int, bits: int, k: int, offset: float) -> dict[str, torch.Tensor]:
    """d coordinates of (k + offset)·2^-bits: each rounds up to (k+1)·2^-bits when offset > ½."""
    value = (k + offset) * 2.0 ** -bits
    return {"g0": torch.full((d,), value, dtype=torch.float64)}


def test_without_the_reserve_rounding_lifts_an_update_past_c_and_with_it_does_not():
    d, bits, k = 4096, 24, 2 ** 18
    groups = [GroupSpec("g0", "decoder", d, (d,))]
    c = math.sqrt(d) * (k + 0.7) * 2.0 ** -bits  # C/√d sits between a grid point and the next
    update = _tie_update(d, bits, k, 0.6)  # norm < C: not clipped; encodes to (k+1)·2^-bits each
    plain = make_policy(privacy(clipping="flat", clip_norm=c), groups)
    passed = plain.clip(update).update
    assert not plain.clip(update).clipped
    assert encoded_norm(passed, bits) > c  # the encoded sensitivity would exceed C
    reserved = make_policy(privacy(clipping="flat", clip_norm=c), groups)
    reserved.reserve_encoding(bits)
    assert encoded_norm(reserved.clip(update).update, bits) <= c
    assert reserved.threshold_scale == pytest.approx(1 - encoding_margin(d, bits) / c, rel=1e-12)


def test_too_few_fractional_bits_for_the_model_size_are_refused():
    groups = [GroupSpec("g0", "decoder", 10 ** 6, (10 ** 6,))]
    assert encoding_margin(10 ** 6, 8) == pytest.approx(1.953125)
    policy = make_policy(privacy(clipping="flat", clip_norm=1.0), groups)
    with pytest.raises(ConfigError, match=r"aggregation\.fixed_point_bits.*at least 19"):
        policy.reserve_encoding(8)
    policy.reserve_encoding(19)  # the suggested minimum is accepted
    policy.reserve_encoding(32)  # the default: a margin of 1.2e-7


def test_the_statistic_and_diagnostics_keep_their_bounds_through_the_encoding():
    groups = [GroupSpec(f"g{i}", "decoder", 50, (50,)) for i in range(9)]
    ema = make_policy(privacy(clipping="size-ema", stat_clip=0.5), groups)
    ema.reserve_encoding(16)
    update = {g.name: torch.full((50,), 3.0) for g in groups}
    stat = ema.statistic(ema.clip(update))
    assert float(decode(encode(stat, 16), 16).norm()) <= 0.5
    quantile = make_policy(privacy(clipping="quantile"), groups)
    flags = quantile.statistic(quantile.clip(update))
    assert torch.equal(decode(encode(flags, 16), 16), flags)  # ±½ lies on the grid
    entries = torch.rand(1000, dtype=torch.float64)
    enc = decode(encode(entries, 8), 8)
    assert float(enc.min()) >= 0.0 and float(enc.max()) <= 1.0  # [0, 1] rounds within [0, 1]

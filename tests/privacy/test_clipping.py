"""Clipping policies: the joint bound ‖clip(Δ)‖ ≤ C for every input, Σ C_h² = C², pool shares,
α-split effective σ, frozen encoder, the probe rule, and the registry."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_fl.config import CLIPPING_METHODS, INSIDE_POOL_RULES, ConfigError
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy import POLICIES, effective_noise_multipliers, make_policy
from privacy_helpers import privacy, random_update, speech_groups, update_norm

COMPONENTS = ("encoder", "connector", "decoder")
SPECIAL = {"zero": 0.0, "huge": 1e30, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
           "tiny": 1e-30}


def method_configs():
    """(method, inside_pool) for every registry entry; pooled methods with every inside rule."""
    out = []
    for m in CLIPPING_METHODS:
        rules = INSIDE_POOL_RULES if m in ("alpha-split", "pools") else ("size",)
        out += [(m, r) for r in rules]
    return out


METHODS = method_configs()


@st.composite
def layouts_and_updates(draw):
    n = draw(st.integers(1, 6))
    groups, update = [], {}
    for i in range(n):
        numel = draw(st.integers(1, 40))
        comp = draw(st.sampled_from(COMPONENTS))
        groups.append(GroupSpec(f"g.{i}", comp, numel, (numel,)))
        kind = draw(st.sampled_from(["normal", "normal", "scaled"] + list(SPECIAL)))
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
        seed = draw(st.integers(0, 2**31 - 1))
        t = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        if kind == "scaled":
            t = t * 10.0 ** draw(st.integers(-20, 35))
        elif kind in SPECIAL:
            pos = draw(st.integers(0, numel - 1))
            if kind in ("zero", "huge", "tiny"):
                t = torch.full((numel,), SPECIAL[kind], dtype=torch.float64)
            else:
                t[pos] = SPECIAL[kind]
        update[f"g.{i}"] = t.to(dtype)
    return groups, update


def policy_for(method, inside, groups, probe_file, **kw):
    cfg = privacy(clipping=method, inside_pool=inside, probe_norms=probe_file, **kw)
    return make_policy(cfg, groups)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=layouts_and_updates(), which=st.sampled_from(METHODS),
       clip_norm=st.sampled_from([1e-3, 0.5, 1.0, 7.0]),
       adapt=st.lists(st.floats(-1e6, 1e6), min_size=0, max_size=2))
def test_every_policy_bounds_joint_norm_for_any_input(data, which, clip_norm, adapt, probe_file):
    groups, update = data
    method, inside = which
    policy = policy_for(method, inside, groups, probe_file, clip_norm=clip_norm)
    for a in adapt:  # adaptive policies: arbitrary (noised) statistics must keep the invariants
        policy.update(torch.full((policy.statistic_size,), a, dtype=torch.float64), 3.0)
    res = policy.clip(update)
    assert set(res.update) == set(update)
    for h, t in res.update.items():
        assert t.shape == update[h].shape
        assert t.dtype in (torch.float32, torch.float64)
        assert bool(torch.isfinite(t).all())
    # exact, no tolerance: a clipped unit is scaled to its threshold × (1 − MARGIN), so the
    # float32 cast and the float64 norm cannot reach C (a 1e-6 slack hid a +MARGIN bug)
    assert update_norm(res.update) <= clip_norm
    thr = policy.thresholds()
    for h, t in res.update.items():  # each group within its own threshold
        assert float(t.double().norm()) <= thr[h]
    nonfinite = not all(bool(torch.isfinite(t).all()) for t in update.values())
    assert res.nonfinite == nonfinite
    if nonfinite:
        assert update_norm(res.update) == 0.0


@settings(max_examples=40, deadline=None)
@given(data=layouts_and_updates(), which=st.sampled_from(METHODS),
       adapt=st.lists(st.floats(-1e3, 1e3), min_size=0, max_size=3))
def test_budget_sums_to_c_squared(data, which, adapt, probe_file):
    groups, _ = data
    method, inside = which
    policy = policy_for(method, inside, groups, probe_file, clip_norm=2.5)
    for a in adapt:
        policy.update(torch.linspace(-a, a, policy.statistic_size, dtype=torch.float64), 2.0)
    c2 = 2.5 ** 2
    pools = policy.pool_thresholds()
    assert math.fsum(v * v for v in pools.values()) == pytest.approx(c2, rel=1e-9)
    thr = policy.thresholds()
    for pool in policy.pools:
        if pool.rule == "flat":
            assert all(thr[h] == pools[pool.name] for h in pool.groups)
        else:  # per-layer pools: Σ_{h∈k} C_h² = α_k C²
            assert math.fsum(thr[h] ** 2 for h in pool.groups) == pytest.approx(
                pool.share * c2, rel=1e-9)
    if all(p.rule != "flat" for p in policy.pools):
        assert math.fsum(v * v for v in thr.values()) == pytest.approx(c2, rel=1e-9)


def test_registry_names_match_config():
    assert tuple(POLICIES) == CLIPPING_METHODS


def test_flat_is_global_scaling():
    groups = speech_groups()
    upd = random_update(groups, {"encoder": 1.0, "connector": 1.0, "decoder": 1.0})
    res = make_policy(privacy(clipping="flat", clip_norm=1.0), groups).clip(upd)
    factor = update_norm(res.update) / update_norm(upd)
    for h in upd:  # one common factor for every group
        assert torch.allclose(res.update[h].double(), upd[h].double() * factor, rtol=1e-5)
    assert update_norm(res.update) == pytest.approx(1.0, rel=1e-5)
    assert update_norm(res.update) <= 1.0  # exactly: scaled to C·(1 − MARGIN), never above C
    assert res.pool_retained["all"] == pytest.approx(factor, rel=1e-5)


def test_small_update_passes_unchanged():
    groups = speech_groups()
    upd = random_update(groups, {"encoder": 1e-6, "connector": 1e-6, "decoder": 1e-6})
    for method, inside in METHODS:
        if method == "probe":
            continue
        res = make_policy(privacy(clipping=method, inside_pool=inside), groups).clip(upd)
        assert not res.clipped
        assert all(torch.equal(res.update[h], upd[h]) for h in upd)


def test_size_and_uniform_thresholds():
    groups = speech_groups(n_enc=2, n_dec=2, enc_numel=10, dec_numel=30)
    size = make_policy(privacy(clipping="size", clip_norm=2.0), groups).thresholds()
    total = sum(g.numel for g in groups)
    for g in groups:
        assert size[g.name] == pytest.approx(2.0 * math.sqrt(g.numel / total), rel=1e-12)
    uni = make_policy(privacy(clipping="uniform", clip_norm=2.0), groups).thresholds()
    assert all(v == pytest.approx(2.0 / math.sqrt(len(groups))) for v in uni.values())


def test_alpha_split_effective_noise_multipliers():
    groups = speech_groups()
    policy = make_policy(privacy(clipping="alpha-split", alpha=0.05, noise_multiplier=0.1), groups)
    assert [p.name for p in policy.pools] == ["encoder", "decoder"]
    assert set(policy.pools[1].groups) == {"conn.w", "conn.b"} | {f"dec.{i}" for i in range(4)}
    pools, per_group = effective_noise_multipliers(policy, 0.1)
    assert round(pools["encoder"], 4) == 0.4472
    assert round(pools["decoder"], 4) == 0.1026
    # size rule inside the encoder pool: C_h = C·√α·√(p_h/Σ_E p)
    thr = policy.thresholds()
    assert thr["enc.0"] == pytest.approx(math.sqrt(0.05) * math.sqrt(32 / 128), rel=1e-12)
    assert per_group["enc.0"] == pytest.approx(0.1 / thr["enc.0"], rel=1e-12)


def test_alpha_split_frozen_encoder_gives_decoder_whole_budget():
    groups = speech_groups(n_enc=0)
    policy = make_policy(privacy(clipping="alpha-split", alpha=0.05), groups)
    assert [(p.name, p.share) for p in policy.pools] == [("decoder", 1.0)]
    assert any("encoder" in n for n in policy.notes)
    thr = policy.thresholds()
    assert math.fsum(v * v for v in thr.values()) == pytest.approx(1.0, rel=1e-12)
    pools, _ = effective_noise_multipliers(policy, 0.1)
    assert pools == {"decoder": pytest.approx(0.1)}


def test_pools_shares_and_coverage():
    groups = speech_groups()
    three = ({"name": "a", "components": ["encoder"], "share": 0.1},
             {"name": "b", "components": ["connector"], "share": 0.3},
             {"name": "c", "components": ["decoder"], "share": 0.6})
    policy = make_policy(privacy(clipping="pools", pools=three, inside_pool="uniform"), groups)
    thr, pt = policy.thresholds(), policy.pool_thresholds()
    for p, share in zip(policy.pools, (0.1, 0.3, 0.6)):
        assert p.share == pytest.approx(share)
        assert pt[p.name] == pytest.approx(math.sqrt(share))
        assert math.fsum(thr[h] ** 2 for h in p.groups) == pytest.approx(share)
    with pytest.raises(ConfigError, match="privacy.pools"):  # decoder in no pool
        make_policy(privacy(clipping="pools", pools=three[:2] + (
            {"name": "c", "components": ["other"], "share": 0.6},)), groups)
    with pytest.raises(ConfigError, match="privacy.pools"):  # encoder in two pools
        make_policy(privacy(clipping="pools", pools=(
            {"name": "a", "components": ["encoder"], "share": 0.5},
            {"name": "b", "components": ["encoder", "connector", "decoder"], "share": 0.5})),
            groups)


def test_pools_flat_inside_clips_each_pool_jointly():
    groups = speech_groups()
    policy = make_policy(privacy(clipping="alpha-split", inside_pool="flat", alpha=0.25), groups)
    upd = random_update(groups, {"encoder": 10.0, "connector": 1e-4, "decoder": 1e-4})
    res = policy.clip(upd)
    enc = {h: t for h, t in res.update.items() if h.startswith("enc")}
    assert update_norm(enc) == pytest.approx(0.5, rel=1e-5)  # √0.25 · C
    assert res.pool_clipped == {"encoder": True, "decoder": False}
    assert all(torch.equal(res.update[h], upd[h]) for h in upd if not h.startswith("enc"))


def test_scaling_one_client_by_1e6_moves_the_sum_by_at_most_its_threshold():
    groups = speech_groups()
    policy = make_policy(privacy(clipping="alpha-split", clip_norm=1.0), groups)
    gen = torch.Generator().manual_seed(3)
    clients = [random_update(groups, gen=gen) for _ in range(5)]
    thr = policy.thresholds()

    def summed(updates):
        out = {h: torch.zeros(g.numel, dtype=torch.float64) for h, g in
               ((g.name, g) for g in groups)}
        for u in updates:
            for h, t in policy.clip(u).update.items():
                out[h] += t.double()
        return out

    without = summed(clients[1:])
    loud = {h: t * 1e6 for h, t in clients[0].items()}
    with_loud = summed([loud] + clients[1:])
    diff = {h: with_loud[h] - without[h] for h in without}
    assert update_norm(diff) <= 1.0  # add/remove sensitivity C, exactly (see above)
    for h in diff:
        assert float(diff[h].norm()) <= thr[h]


@pytest.mark.parametrize("method", ["size", "uniform"])
@pytest.mark.parametrize("over", [1.01, 1.5, 1.99])
def test_a_unit_just_over_its_threshold_is_clipped_to_it_and_only_it(method, over):
    # deterministic companion of the property test (whose random draws need not land between
    # C_u and 2·C_u): one group at `over` × its threshold, the others at a tenth of theirs
    groups = speech_groups()
    policy = make_policy(privacy(clipping=method, clip_norm=1.0), groups)
    thr = policy.thresholds()
    loud = groups[-1].name
    upd = {g.name: torch.full((g.numel,), (over if g.name == loud else 0.1) * thr[g.name]
                              / math.sqrt(g.numel), dtype=torch.float32) for g in groups}
    res = policy.clip(upd)
    assert res.group_clipped == {g.name: g.name == loud for g in groups}
    assert float(res.update[loud].double().norm()) == pytest.approx(thr[loud], rel=1e-5)
    assert float(res.update[loud].double().norm()) <= thr[loud]
    for g in groups:
        if g.name != loud:
            assert torch.equal(res.update[g.name], upd[g.name])


def test_nonfinite_update_is_zeroed_and_counted():
    groups = speech_groups()
    upd = random_update(groups)
    upd["dec.1"][3] = math.nan
    res = make_policy(privacy(clipping="size"), groups).clip(upd)
    assert res.nonfinite and res.clipped
    assert all(float(t.abs().sum()) == 0.0 for t in res.update.values())
    assert math.isnan(res.total_norm)


def test_clip_result_statistics():
    groups = speech_groups()
    policy = make_policy(privacy(clipping="alpha-split", alpha=0.05), groups)
    upd = random_update(groups, {"encoder": 1.0, "connector": 1e-5, "decoder": 1e-5})
    res = policy.clip(upd)
    assert res.group_norms["enc.0"] == pytest.approx(float(upd["enc.0"].double().norm()))
    assert res.group_clipped["enc.0"] and not res.group_clipped["dec.0"]
    assert res.pool_clipped == {"encoder": True, "decoder": False}
    assert res.pool_retained["decoder"] == 1.0
    enc_raw = math.sqrt(sum(res.group_norms[f"enc.{i}"] ** 2 for i in range(4)))
    assert res.pool_norms["encoder"] == pytest.approx(enc_raw)
    assert res.pool_retained["encoder"] == pytest.approx(math.sqrt(0.05) / enc_raw, rel=1e-5)
    assert res.total_norm == pytest.approx(update_norm(upd))


def test_probe_rule_is_proportional_to_probe_norms(probe_file):
    import json
    norms = json.loads(open(probe_file).read())
    groups = speech_groups(n_enc=3, n_dec=3)
    thr = make_policy(privacy(clipping="probe", probe_norms=probe_file, clip_norm=3.0),
                      groups).thresholds()
    ratio = {h: thr[h] / norms[h] for h in thr}
    assert max(ratio.values()) == pytest.approx(min(ratio.values()), rel=1e-9)
    with pytest.raises(ConfigError, match="privacy.probe_norms"):
        make_policy(privacy(clipping="probe"), groups)  # no file given
    bad = [GroupSpec("missing", "decoder", 3)]
    with pytest.raises(ConfigError, match="missing"):
        make_policy(privacy(clipping="probe", probe_norms=probe_file), bad)


def test_mismatched_update_is_rejected():
    groups = speech_groups()
    policy = make_policy(privacy(clipping="size"), groups)
    upd = random_update(groups)
    upd.pop("dec.0")
    with pytest.raises(ValueError, match="missing"):
        policy.clip(upd)

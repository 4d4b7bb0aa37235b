"""``privacy.grouping``: per-matrix (default) or per-layer clipping units.

With ``layer``, every per-layer method clips all matrices of one transformer layer of one
component as one unit: one norm, one threshold, one scale. What must hold: the joint bound C for
any input, one common factor per unit, the same policy as ``matrix`` when every layer has one
matrix, thresholds ∝ √(unit size) for ``size``, the expected units for the tiny model, a clear
error for an unknown grouping, and unchanged run ids at the default.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_fl.config import CLIPPING_METHODS, INSIDE_POOL_RULES, ConfigError, PrivacyConfig
from cluster_fl.groups import GroupSpec, clipping_units, layer_of
from cluster_fl.privacy import make_policy
from privacy_helpers import privacy, update_norm
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

PER_LAYER = ("uniform", "size", "uniform-ema", "size-ema", "quantile", "probe")


def method_configs(per_layer_only: bool = False):
    """(method, inside_pool) pairs: every method, pooled ones with every inside rule."""
    out = []
    for m in CLIPPING_METHODS:
        rules = INSIDE_POOL_RULES if m in ("alpha-split", "pools") else ("size",)
        out += [(m, r) for r in rules
                if not per_layer_only or (m in PER_LAYER or (m in ("alpha-split", "pools")
                                                             and r != "flat"))]
    return out


def layered_groups(enc_layers, dec_layers, conn):
    """Groups named like models/lora.py: ``encoder.layers.i.<matrix>``, ``decoder.model.layers.i
    .<matrix>``, ``connector.<name>``; each layer is a list of matrix sizes."""
    gs = []
    for i, sizes in enumerate(enc_layers):
        gs += [GroupSpec(f"encoder.layers.{i}.m{j}", "encoder", n, (n,)) for j, n in enumerate(sizes)]
    gs += [GroupSpec(f"connector.p{j}", "connector", n, (n,)) for j, n in enumerate(conn)]
    for i, sizes in enumerate(dec_layers):
        gs += [GroupSpec(f"decoder.model.layers.{i}.m{j}", "decoder", n, (n,))
               for j, n in enumerate(sizes)]
    return gs


@pytest.fixture(scope="module")
def layer_probe(tmp_path_factory):
    """A probe file with a norm for every group name ``layered_groups`` can produce."""
    import json

    names = [f"encoder.layers.{i}.m{j}" for i in range(4) for j in range(6)]
    names += [f"decoder.model.layers.{i}.m{j}" for i in range(4) for j in range(6)]
    names += [f"connector.p{j}" for j in range(3)]
    path = tmp_path_factory.mktemp("probe") / "probe.json"
    path.write_text(json.dumps({n: 0.01 * (1 + i % 7) for i, n in enumerate(names)}))
    return str(path)


layer_sizes = st.lists(st.integers(1, 24), min_size=1, max_size=6)


@st.composite
def layouts_and_updates(draw, one_matrix_per_layer=False):
    sizes = st.lists(st.integers(1, 24), min_size=1, max_size=1) if one_matrix_per_layer \
        else layer_sizes
    enc = draw(st.lists(sizes, min_size=0, max_size=4))
    dec = draw(st.lists(sizes, min_size=1, max_size=4))
    conn = draw(st.lists(st.integers(1, 24), min_size=0 if not one_matrix_per_layer else 1,
                         max_size=1 if one_matrix_per_layer else 3))
    groups = layered_groups(enc, dec, conn)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    scale = {g.component: 10.0 ** draw(st.integers(-4, 2)) for g in groups}
    update = {g.name: torch.randn(g.numel, generator=gen, dtype=torch.float64) * scale[g.component]
              for g in groups}
    special = draw(st.sampled_from(["none", "none", "nan", "inf", "huge", "zero"]))
    if special != "none":
        victim = draw(st.sampled_from([g.name for g in groups]))
        update[victim] = update[victim].clone()
        update[victim][0] = {"nan": math.nan, "inf": math.inf, "huge": 1e30, "zero": 0.0}[special]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return groups, {k: v.to(dtype) for k, v in update.items()}


def policy_for(method, inside, groups, probe, grouping="layer", **kw):
    cfg = privacy(clipping=method, inside_pool=inside, probe_norms=probe, grouping=grouping, **kw)
    return make_policy(cfg, groups)


def adapt(policy, values):
    for a in values:  # arbitrary (noised) statistics must keep every invariant
        policy.update(torch.linspace(-a, a, policy.statistic_size, dtype=torch.float64), 3.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=layouts_and_updates(), which=st.sampled_from(method_configs()),
       clip_norm=st.sampled_from([1e-3, 0.3, 1.0, 5.0]),
       stats=st.lists(st.floats(-1e3, 1e3), max_size=2))
def test_layer_grouping_bounds_joint_norm_by_c(data, which, clip_norm, stats, layer_probe):
    groups, update = data
    policy = policy_for(*which, groups, layer_probe, clip_norm=clip_norm)
    adapt(policy, stats)
    res = policy.clip(update)
    assert update_norm(res.update) <= clip_norm * (1 + 1e-6)
    unit_thr = policy.unit_thresholds()
    if all(p.rule != "flat" for p in policy.pools):  # Σ C_u² = C²; each unit within its C_u
        assert math.fsum(c * c for c in unit_thr.values()) == pytest.approx(clip_norm ** 2,
                                                                            rel=1e-9)
        for u in policy.units:
            kept = math.sqrt(math.fsum(float(res.update[h].double().pow(2).sum()) for h in u.members))
            assert kept <= unit_thr[u.name] * (1 + 1e-6)
    thr = policy.thresholds()
    assert all(thr[h] == unit_thr[policy.unit_of()[h]] for h in thr)  # a group reports its unit's


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=layouts_and_updates(), which=st.sampled_from(method_configs(per_layer_only=True)),
       clip_norm=st.sampled_from([1e-3, 0.05, 1.0]),
       stats=st.lists(st.floats(-1e3, 1e3), max_size=2))
def test_a_unit_is_scaled_by_one_common_factor(data, which, clip_norm, stats, layer_probe):
    groups, update = data
    policy = policy_for(*which, groups, layer_probe, clip_norm=clip_norm)
    adapt(policy, stats)
    res = policy.clip(update)
    if res.nonfinite:
        return
    unit_thr = policy.unit_thresholds()
    for u in policy.units:
        assert len({res.group_clipped[h] for h in u.members}) == 1
        raw = math.sqrt(math.fsum(float(update[h].double().pow(2).sum()) for h in u.members))
        factors = set()
        for h in u.members:
            x, y = update[h].double(), res.update[h].double()
            if float(x.abs().max()) > 0:
                f = float((x * y).sum() / (x * x).sum())  # y = f·x
                assert torch.allclose(y, f * x, rtol=1e-6, atol=0.0)
                factors.add(f)
        if factors:
            assert max(factors) - min(factors) <= 1e-6 * max(factors)
            expected = min(1.0, unit_thr[u.name] / raw) if raw > 0 else 1.0
            assert max(factors) == pytest.approx(expected, rel=1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=layouts_and_updates(one_matrix_per_layer=True), which=st.sampled_from(method_configs()),
       stats=st.lists(st.floats(-1e3, 1e3), max_size=2))
def test_matrix_and_layer_coincide_when_every_layer_has_one_matrix(data, which, stats,
                                                                   layer_probe):
    groups, update = data
    by_matrix = policy_for(*which, groups, layer_probe, grouping="matrix", clip_norm=0.2)
    by_layer = policy_for(*which, groups, layer_probe, grouping="layer", clip_norm=0.2)
    assert len(by_layer.units) == len(by_matrix.units) == len(groups)
    for p in (by_matrix, by_layer):
        adapt(p, stats)
    assert by_layer.thresholds() == by_matrix.thresholds()
    a, b = by_matrix.clip(update), by_layer.clip(update)
    for h in update:
        assert torch.equal(a.update[h], b.update[h])
    assert a.group_clipped == b.group_clipped and a.pool_retained == b.pool_retained
    if by_matrix.adaptive:
        assert torch.equal(by_matrix.statistic(a), by_layer.statistic(b))


def test_units_of_the_tiny_model():
    from cluster_fl.config import ModelConfig
    from cluster_fl.models.lora import describe_groups

    groups = describe_groups(ModelConfig(arch="whisper-tinyllama-tiny"))
    assert len(groups) == 38 and len(clipping_units(groups, "matrix")) == 38
    units = clipping_units(groups, "layer")
    # 3 encoder layers x q/k/v x A/B, the connector's weight and bias, 3 decoder layers
    assert [(u.name, u.component, len(u.members)) for u in units] == (
        [(f"encoder.layers.{i}", "encoder", 6) for i in range(3)] + [("connector", "connector", 2)]
        + [(f"decoder.model.layers.{i}", "decoder", 6) for i in range(3)])
    assert sum(u.numel for u in units) == sum(g.numel for g in groups)
    assert {layer_of(g) for g in groups} == {u.name for u in units}
    frozen = clipping_units(describe_groups(ModelConfig(arch="whisper-tinyllama-tiny",
                                                        freeze_encoder=True)), "layer")
    assert [u.name for u in frozen] == ["connector"] + [f"decoder.model.layers.{i}" for i in range(3)]


def test_size_with_layer_grouping_gives_thresholds_proportional_to_root_unit_size():
    groups = layered_groups([[8, 8, 8], [8, 8, 8]], [[20, 5, 5], [20, 5, 5], [20, 5, 5]], [64, 8])
    policy = make_policy(privacy(clipping="size", clip_norm=2.0, grouping="layer"), groups)
    units = {u.name: u.numel for u in policy.units}
    assert units == {"encoder.layers.0": 24, "encoder.layers.1": 24, "connector": 72,
                     **{f"decoder.model.layers.{i}": 30 for i in range(3)}}
    total = sum(units.values())
    for u, c in policy.unit_thresholds().items():
        assert c == pytest.approx(2.0 * math.sqrt(units[u] / total), rel=1e-12)
    # uniform: C/√(number of layers), the paper's 1/√46 at C = 1 with 46 layers
    uniform = make_policy(privacy(clipping="uniform", clip_norm=1.0, grouping="layer"), groups)
    assert all(c == pytest.approx(1 / math.sqrt(6)) for c in uniform.unit_thresholds().values())
    # α-split's pools are unchanged; inside each pool the units share it by size
    split = make_policy(privacy(clipping="alpha-split", alpha=0.1, grouping="layer"), groups)
    assert [(p.name, len(p.units)) for p in split.pools] == [("encoder", 2), ("decoder", 4)]
    enc = {u: c for u, c in split.unit_thresholds().items() if u.startswith("encoder")}
    assert enc == {u: pytest.approx(math.sqrt(0.1 / 2)) for u in enc}


def test_flat_clipping_does_not_depend_on_grouping():
    groups = layered_groups([[8, 8]], [[20, 5]], [16])
    gen = torch.Generator().manual_seed(3)
    update = {g.name: torch.randn(g.numel, generator=gen) for g in groups}
    a = make_policy(privacy(clipping="flat", clip_norm=0.5), groups).clip(update)
    b = make_policy(privacy(clipping="flat", clip_norm=0.5, grouping="layer"), groups).clip(update)
    assert all(torch.equal(a.update[h], b.update[h]) for h in update)


def test_adaptive_statistics_have_one_entry_per_unit():
    groups = layered_groups([[8, 8, 8]], [[20, 5], [20, 5]], [16, 4])
    for method in ("size-ema", "quantile"):
        policy = make_policy(privacy(clipping=method, grouping="layer"), groups)
        assert policy.statistic_size == len(policy.units) == 4
        stat = policy.statistic({g.name: torch.ones(g.numel) for g in groups})
        assert stat.shape == (4,)
        policy.update(stat * 3, 3.0)
        state = policy.state_dict()
        assert state["units"] == [u.name for u in policy.units]
        with pytest.raises(ValueError, match="grouping"):
            make_policy(privacy(clipping=method), groups).load_state_dict(state)
    matrix = make_policy(privacy(clipping="size-ema"), groups)
    assert "units" not in matrix.state_dict()  # checkpoints of matrix runs keep their format


def test_group_table_names_each_groups_unit_and_the_audit_canary_keeps_c():
    import numpy as np

    from cluster_fl.audit.battery import canary_thresholds

    groups = layered_groups([[8, 8, 8]], [[20, 5], [20, 5]], [16, 4])
    for grouping in ("matrix", "layer"):
        policy = make_policy(privacy(clipping="size", clip_norm=1.5, grouping=grouping), groups)
        table = policy.group_table()
        assert [row["unit"] for row in table] == [policy.unit_of()[g.name] for g in groups]
        radii = canary_thresholds(table)
        assert math.sqrt(math.fsum(r * r for r in radii.values())) == pytest.approx(1.5, rel=1e-12)
        if grouping == "matrix":
            assert radii == {row["name"]: row["threshold"] for row in table}
    legacy = [{k: v for k, v in row.items() if k != "unit"} for row in
              make_policy(privacy(clipping="size"), groups).group_table()]
    assert np.isclose(math.fsum(r * r for r in canary_thresholds(legacy).values()), 1.0)


def test_unknown_grouping_is_a_clear_config_error():

    with pytest.raises(ConfigError, match=r"privacy\.grouping.*'layers'.*allowed: matrix, layer"):
        PrivacyConfig(grouping="layers")
    with pytest.raises(ConfigError, match=r"privacy\.grouping"):
        resolved_config(None, ["privacy.grouping=block"])
    assert resolved_config(None, ["privacy.grouping=layer"]).privacy.grouping == "layer"
    with pytest.raises(ValueError, match="grouping"):
        clipping_units([GroupSpec("a", "encoder", 1)], "block")


def test_the_run_id_is_unchanged_at_the_default_grouping(monkeypatch):
    from cluster_fl.engine import rundir

    default = resolved_config(None, ["model.dtype=float32",  # the base dtype of those runs
                                     "eval.max_new_tokens=64"])  # and their decoding limit
    assert default.privacy.grouping == "matrix"
    before = rundir.run_id(default)
    # the id of the default config, as before privacy.grouping existed (tests/engine too)
    assert before == "whisper-tinyllama-tiny_unfrozen_alpha-split_s0_6c0e30c8"
    real = rundir.to_dict

    def without_grouping(cfg):
        tree = real(cfg)
        tree["privacy"].pop("grouping")
        return tree

    monkeypatch.setattr(rundir, "to_dict", without_grouping)
    assert rundir.run_id(default) == before  # as if the key did not exist
    monkeypatch.undo()
    assert rundir.run_id(resolved_config(None, ["privacy.grouping=layer"])) != before

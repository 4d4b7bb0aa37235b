"""The per-client tail reads the device back once: clipping, the secure-sum range checks and the
non-private measurement each make one host transfer per client, whatever the number of tensors
(on a GPU every read is a synchronisation: 3 per tensor before, 446 tensors at 9B). Counted on
CPU by wrapping every Tensor -> Python conversion (tests/host_syncs.py); the values are those of
the per-tensor code. The engine's whole tail -- one read per block -- is counted in
tests/engine/test_host_syncs.py.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from host_syncs import HostReads

from cluster_fl.config import PrivacyConfig
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy.clipping import make_policy, norm_parts, safe_norm
from cluster_fl.privacy.diagnostics import Diagnostics
from cluster_fl.secure_sum import SecureSummer, SecureSumRangeError


def _reference_norm(t: torch.Tensor) -> float:
    """The per-tensor max-scaled norm the engine used before (three reads per tensor)."""
    x = t.detach().to(torch.float64)
    if x.numel() == 0:
        return 0.0
    top = float(x.abs().max())
    if top == 0.0 or not math.isfinite(top):
        return top
    return top * float(torch.linalg.vector_norm(x / top))


_special = st.sampled_from([0.0, 1e-300, 1e300, -1e308, float("inf"), float("-inf"),
                            float("nan"), 3.5, -2.25])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.floats(-1e6, 1e6), _special), max_size=40), min_size=1,
                max_size=6), st.sampled_from([torch.float32, torch.float64]))
def test_norm_parts_equals_the_per_tensor_norm_bitwise(rows, dtype):
    tensors = [torch.tensor(r, dtype=dtype) for r in rows]
    tops, norms = norm_parts(tensors)
    for t, top, n in zip(tensors, tops, norms):
        ref = _reference_norm(t)
        assert (math.isnan(ref) and math.isnan(n)) or n == ref
        finite = bool(torch.isfinite(t).all())
        assert math.isfinite(top) == finite
        assert safe_norm(t) == n or (math.isnan(n) and math.isnan(safe_norm(t)))


def _groups(n: int) -> list[GroupSpec]:
    comps = ["encoder", "connector", "decoder"]
    return [GroupSpec(f"g{i}", comps[i % 3], 12, (3, 4)) for i in range(n)]


@pytest.mark.parametrize("method", ["flat", "alpha-split", "uniform"])
def test_clip_reads_back_once_per_client(monkeypatch, method):
    groups = _groups(38)  # the tiny model's trainable tensors
    policy = make_policy(PrivacyConfig(clipping=method, clip_norm=1.0), groups)
    g = torch.Generator().manual_seed(0)
    update = {s.name: torch.randn(3, 4, generator=g) for s in groups}
    expected = policy.clip(update)
    reads = HostReads(monkeypatch)
    res = policy.clip(update)
    assert reads.n == 1
    assert res.group_norms == expected.group_norms
    assert all(torch.equal(res.update[k], expected.update[k]) for k in update)
    assert res.group_norms["g5"] == _reference_norm(update["g5"])


def test_clip_of_a_nonfinite_update_still_zeroes_it_after_one_read(monkeypatch):
    groups = _groups(6)
    policy = make_policy(PrivacyConfig(clipping="flat", clip_norm=1.0), groups)
    update = {s.name: torch.ones(3, 4) for s in groups}
    update["g4"][1, 2] = float("nan")
    reads = HostReads(monkeypatch)
    res = policy.clip(update)
    assert reads.n == 1 and res.nonfinite
    assert all(float(v.abs().sum()) == 0.0 for v in res.update.values())


def _summer() -> SecureSummer:
    return SecureSummer({"u": (3, 4), "w": (5,), "stat": 2}, frac_bits=16, max_clients=4,
                        bounds={"u": 1.0, "w": 1.0, "stat": 1.0}, mode="plain", seed=0)


def test_secure_sum_add_reads_back_once_per_device(monkeypatch):
    summer = _summer()
    values = {"u": torch.full((3, 4), 0.25), "w": torch.zeros(5), "stat": torch.tensor([0.5, -1])}
    reads = HostReads(monkeypatch)
    summer.add(values)
    assert reads.n == 1


def test_secure_sum_add_checks_every_field_before_adding_any():
    summer = _summer()
    before = summer.partial()
    with pytest.raises(SecureSumRangeError, match="'stat'"):
        summer.add({"u": torch.full((3, 4), 0.25), "stat": torch.tensor([0.5, 2.0])})
    with pytest.raises(ValueError, match="non-finite"):
        summer.add({"u": torch.full((3, 4), float("nan")), "w": torch.zeros(5)})
    after = summer.partial()
    assert all(torch.equal(before[k], after[k]) for k in before)
    summer.add({"u": torch.full((3, 4), 0.25)})
    assert float(summer.partial()["u"].sum()) == 3.0


def test_nonprivate_measure_reads_back_once(monkeypatch):
    groups = _groups(9)
    diag = Diagnostics(groups, None, PrivacyConfig(mechanism="none", diagnostics="exact"))
    delta = {s.name: torch.full((3, 4), 0.5) for s in groups}
    reads = HostReads(monkeypatch)
    out = diag.measure(delta, max_abs=10.0)
    assert reads.n == 1
    assert out.group_norms["g0"] == pytest.approx(math.sqrt(12 * 0.25), rel=0, abs=1e-15)
    assert not out.nonfinite
    delta["g3"][0, 0] = 20.0  # beyond the fixed-point range: dropped like a non-finite client
    assert diag.measure(delta, max_abs=10.0).nonfinite


@pytest.mark.parametrize("method", ["flat", "alpha-split", "uniform", "size-ema"])
def test_a_block_is_clipped_as_its_clients_one_by_one_with_one_read(monkeypatch, method):
    groups = _groups(12)
    policy = make_policy(PrivacyConfig(clipping=method, clip_norm=1.0), groups)
    g = torch.Generator().manual_seed(3)
    block = [{s.name: torch.randn(3, 4, generator=g) * scale for s in groups}
             for scale in (0.01, 0.3, 5.0, 1e3)]
    block[2]["g7"][0, 0] = float("inf")  # one non-finite client among them
    alone = [policy.clip(u) for u in block]
    reads = HostReads(monkeypatch)
    together = policy.clip_many(block)
    assert reads.n == 1
    for a, b in zip(alone, together):
        assert a.nonfinite == b.nonfinite and a.group_clipped == b.group_clipped
        assert a.pool_retained == b.pool_retained
        assert all(torch.equal(a.update[k], b.update[k]) for k in a.update)
    assert [r.nonfinite for r in together] == [False, False, True, False]


def test_a_block_adds_the_same_integers_as_its_clients_one_by_one(monkeypatch):
    g = torch.Generator().manual_seed(4)
    block = [{"u": torch.rand(3, 4, generator=g) * 2 - 1, "stat": torch.rand(2, generator=g)}
             for _ in range(5)] + [{"w": torch.ones(5) * 0.5}]
    one, many = _summer(), _summer()
    for values in block:
        one.add(values)
    reads = HostReads(monkeypatch)
    many.add_many(block)
    assert reads.n == 1
    assert torch.equal(one._acc, many._acc)  # the int64 buffer, counters included


def test_a_deferred_range_check_reads_nothing_adds_nothing_and_fails_the_reduce(monkeypatch):
    # the engine's tail: the check runs on the device; a failing call adds nothing, and the
    # next reduce (or partial) raises what the immediate check raises, before anything is sent
    from cluster_fl.distributed import LocalComm

    good = [{"u": torch.full((3, 4), 0.25), "stat": torch.tensor([0.5, -1.0])},
            {"w": torch.ones(5) * 0.5}]
    now, later = _summer(), _summer()
    now.add_many(good)
    reads = HostReads(monkeypatch)
    later.add_many(good, defer_check=True)
    later.add_many([{"u": torch.full((3, 4), 0.5)}, {"stat": torch.tensor([0.5, 2.0])}],
                   defer_check=True)
    assert reads.n == 0
    acc = later._acc[:later._reduced]
    assert torch.equal(now._acc[:now._reduced], acc)  # the failing call added nothing
    with pytest.raises(SecureSumRangeError, match="'stat': \\|x\\| = 2 exceeds its bound 1"):
        later.reduce(LocalComm(), 0)
    with pytest.raises(SecureSumRangeError, match="'stat'"):
        later.partial()
    nan = _summer()
    nan.add_many([{"u": torch.full((3, 4), float("nan"))}], defer_check=True)
    with pytest.raises(ValueError, match="'u': non-finite"):
        nan.check()
    ok = _summer()
    ok.add_many(good, defer_check=True)
    ok.check()
    assert torch.equal(ok.reduce(LocalComm(), 0)["u"], now.reduce(LocalComm(), 0)["u"])


def test_nonprivate_measure_of_a_block_reads_back_once(monkeypatch):
    groups = _groups(5)
    diag = Diagnostics(groups, None, PrivacyConfig(mechanism="none", diagnostics="exact"))
    g = torch.Generator().manual_seed(5)
    block = [{s.name: torch.randn(3, 4, generator=g) for s in groups} for _ in range(4)]
    block[1]["g2"][0, 0] = 50.0
    alone = [diag.measure(d, max_abs=10.0) for d in block]
    reads = HostReads(monkeypatch)
    together = diag.measure_many(block, max_abs=10.0)
    assert reads.n == 1
    assert [m.group_norms for m in together] == [m.group_norms for m in alone]
    assert [m.nonfinite for m in together] == [False, True, False, False]

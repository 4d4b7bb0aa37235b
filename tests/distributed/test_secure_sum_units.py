"""Single-process properties of the secure sum: fixed-point encoding, the overflow range check,
the guards on contributions and mask reuse, streaming memory, and mask cancellation with the fake."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_fl.distributed import LocalComm
from cluster_fl.errors import UserError
from cluster_fl.secure_sum import (SecureSummer, SecureSumRangeError, check_range, decode, encode,
                                   mask_mode)


def test_encode_rounds_to_nearest_and_decode_inverts_exactly_on_the_grid():
    x = torch.tensor([0.3, -0.6, 0.125, -0.375, 2.5])
    assert encode(x, 2).tolist() == [1, -2, 0, -2, 10]  # 1.2->1, -2.4->-2, 0.5->0 (even), -1.5->-2
    grid = torch.tensor([1.0, -0.5, 3.25, 0.0], dtype=torch.float64)
    assert torch.equal(decode(encode(grid, 8), 8), grid)
    assert encode(torch.tensor([1.0]), 32).dtype == torch.int64


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=30), st.integers(8, 40))
def test_fixed_point_error_is_at_most_half_a_step_per_value(values, bits):
    x = torch.tensor(values, dtype=torch.float32)
    err = (decode(encode(x, bits), bits) - x.double()).abs().max().item()
    assert err <= 2.0 ** -(bits + 1)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0, width=32), min_size=2, max_size=12), st.randoms())
def test_fixed_point_sum_is_order_independent(values, rnd):
    s = SecureSummer({"v": 1}, frac_bits=32, max_clients=16, bounds=1.0, mode="plain")
    for v in values:
        s.add({"v": v})
    a = s.reduce(LocalComm(), 0)["v"]
    shuffled = list(values)
    rnd.shuffle(shuffled)
    for v in shuffled:
        s.add({"v": v})
    assert torch.equal(a, s.reduce(LocalComm(), 1)["v"])


def test_encode_refuses_non_finite_and_out_of_range_values():
    with pytest.raises(ValueError, match="non-finite"):
        encode(torch.tensor([1.0, float("nan")]), 16)
    with pytest.raises(SecureSumRangeError):
        encode(torch.tensor([2.0**40]), 24)


def test_check_range_raises_with_the_config_key_and_a_safe_setting():
    assert check_range(1.0, 10_000, 32) > 10  # the default config has ample headroom
    with pytest.raises(SecureSumRangeError, match=r"fixed_point_bits <= 43"):
        check_range(1.0, 10**6, 48)
    with pytest.raises(UserError):  # the CLI prints it as one line
        check_range(1e6, 2**20, 40)
    # the boundary: 2^20 clients x 1.0 x 2^42 = 2^62 fits; 2^43 does not
    check_range(1.0 / (1.0 + 2.0**-19), 2**20, 42)
    with pytest.raises(SecureSumRangeError):
        check_range(1.0, 2**20, 43)
    with pytest.raises(SecureSumRangeError):
        SecureSummer({"g": 4}, frac_bits=48, max_clients=10**6, bounds=1.0)


def test_contributions_beyond_their_bound_or_count_are_refused():
    s = SecureSummer({"g": 3, "n": 1}, frac_bits=32, max_clients=2, bounds={"g": 1.0, "n": 1.0},
                     integer_fields=["n"])
    with pytest.raises(SecureSumRangeError, match="exceeds its bound"):
        s.add({"g": torch.tensor([0.0, 1.5, 0.0])})
    with pytest.raises(KeyError):
        s.add({"h": 1.0})
    with pytest.raises(ValueError, match="expected 3"):
        s.add({"g": torch.zeros(4)})
    for _ in range(3):
        s.add({"n": 1})
    with pytest.raises(SecureSumRangeError, match="max_clients=2"):
        s.reduce(LocalComm(), 0)


def test_a_round_and_stream_cannot_be_masked_twice():
    s = SecureSummer({"g": 2}, frac_bits=16, max_clients=4, bounds=1.0, mode="research")
    s.reduce(LocalComm(), 3)
    s.reduce(LocalComm(), 3, stream=1)
    with pytest.raises(ValueError, match="already used"):
        s.reduce(LocalComm(), 3)


def test_mask_mode_follows_the_config_switches():
    assert mask_mode(False, True) == "plain"
    assert mask_mode(True, False) == "research"
    assert mask_mode(True, True) == "secure"
    with pytest.raises(ValueError):
        SecureSummer({"g": 1}, frac_bits=16, max_clients=1, bounds=1.0, mode="none")


class _SimulatedRank(LocalComm):
    """A rank of a bigger world whose all-reduce is done by the test (masks are applied before it)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def all_reduce_sum(self, tensor, *, slow=False):
        self.sent = tensor.clone()
        raise _Sent  # the other ranks are not there: stop before decoding


class _Sent(Exception):
    pass


def test_research_masks_of_four_ranks_cancel_mod_2_64():
    world, sent = 4, []
    x = {r: torch.rand(1000, generator=torch.Generator().manual_seed(r)) * 2 - 1
         for r in range(world)}
    for r in range(world):
        comm = _SimulatedRank(r, world)
        s = SecureSummer({"g": 1000}, frac_bits=32, max_clients=8, bounds=1.0, mode="research",
                         seed=5)
        s.add({"g": x[r]})
        with pytest.raises(_Sent):
            s.reduce(comm, 7)
        sent.append(comm.sent.numpy().view(np.uint64))
    total = sent[0].copy()
    for part in sent[1:]:
        total += part  # uint64 wraps
    expected = sum(encode(x[r], 32) for r in range(world))
    assert np.array_equal(total[:1000].view(np.int64), expected.numpy())
    assert total[1000] == world  # the contribution counter at the tail cancels too
    assert not np.array_equal(sent[0][:1000].view(np.int64), encode(x[0], 32).numpy())


def test_masked_partial_is_exactly_what_reduce_sends():
    # the audit's synthetic runs record masked_partial(); it must be the engine's wire view
    for r in range(3):
        s = SecureSummer({"g": 64}, frac_bits=32, max_clients=8, bounds=1.0, mode="research",
                         seed=5)
        s.add({"g": torch.linspace(-1, 1, 64)})
        view = s.masked_partial(r, 3, 7, record=True)
        recorded = s.last_partial
        comm = _SimulatedRank(r, 3)
        with pytest.raises(_Sent):
            s.reduce(comm, 7, record=True)
        assert torch.equal(view, comm.sent) and torch.equal(recorded["masked"], comm.sent)


def test_running_sum_memory_does_not_grow_with_clients():
    s = SecureSummer({"g": 10_000}, frac_bits=32, max_clients=10_000, bounds=1.0)
    before = s._acc.data_ptr(), s._acc.numel()
    for k in range(200):
        s.add({"g": torch.full((10_000,), 0.001 * (k % 7))})
    assert (s._acc.data_ptr(), s._acc.numel()) == before
    total = s.reduce(LocalComm(), 0)["g"]
    assert torch.allclose(total, torch.full((10_000,), sum(0.001 * (k % 7) for k in range(200)),
                                            dtype=torch.float64), atol=200 * 2.0**-33)


def test_an_offset_is_summed_once_within_its_bound_and_never_in_the_partial():
    """Rank 0's noise enters the sum before the all-reduce: the total every rank decodes is
    clients + offset, the rank's own partial stays the clients' alone, and an offset beyond its
    reserved tail (or a second one in a reduction) is refused."""
    s = SecureSummer({"g": 4, "h": 2}, frac_bits=32, max_clients=3, bounds=1.0,
                     offset_bounds={"g": 64.0}, mode="research", seed=1)
    x = torch.tensor([0.5, -0.25, 1.0, 0.0])
    s.add({"g": x})
    noise = torch.tensor([3.0, -40.5, 0.125, 63.0], dtype=torch.float64)
    s.add_offset({"g": noise})
    assert torch.equal(s.partial()["g"], x.double())  # the rank's own, noise-free partial
    with pytest.raises(ValueError, match="already added"):
        s.add_offset({"g": noise})
    total = s.reduce(LocalComm(), 0)
    assert torch.equal(total["g"], x.double() + noise) and torch.equal(total["h"], torch.zeros(2))
    assert s.reduce(LocalComm(), 1)["g"].abs().max() == 0  # reset: the offset was used once
    with pytest.raises(SecureSumRangeError, match="offset bound"):
        s.add_offset({"g": torch.tensor([0.0, 0.0, 64.5, 0.0])})
    with pytest.raises(SecureSumRangeError, match="offset bound 0"):  # no tail reserved
        s.add_offset({"h": torch.tensor([0.1, 0.0])})


def test_the_range_check_reserves_the_offset_tail():
    # 2^20 clients at |x| <= 1 with 42 bits fill int64 to 2^62: an offset of 2^20 more does not fit
    check_range(0.5, 2**20, 42, offset=2.0**19)
    with pytest.raises(SecureSumRangeError, match="noise"):
        check_range(1.0, 2**20, 42, offset=2.0**21)
    with pytest.raises(SecureSumRangeError):
        SecureSummer({"g": 4}, frac_bits=42, max_clients=2**20, bounds=1.0,
                     offset_bounds={"g": 2.0**21})


def test_a_private_sum_sends_no_exact_contribution_counts():
    """The per-field counts rode in the masked buffer and every rank decoded the exact number of
    contributing clients (item 8); a DP run's buffer carries zeros there, and its sum
    is the same."""
    def summed(release: bool):
        s = SecureSummer({"g": 3}, frac_bits=32, max_clients=8, bounds=1.0, mode="plain",
                         release_counts=release)
        for x in (0.25, -0.5, 0.125):
            s.add({"g": torch.full((3,), x, dtype=torch.float64)})
        wire = s.masked_partial(0, 1, round=1)
        return wire, s.reduce(LocalComm(), round=1)["g"]

    shown, total = summed(True)
    hidden, same = summed(False)
    assert int(shown[-1]) == 3 and int(hidden[-1]) == 0  # the count travelled; now it does not
    assert torch.equal(total, same)

"""The secure sum across real gloo ranks: exact (bit-identical to the plain fixed-point sum and to
the 1-process fake for 1, 2 and 3 ranks, whatever the split), masks that cancel (research and secure
mode), fresh secure keys per run, and masked partial sums that carry no trace of the input.

One parity run per world size (``run_parity``) feeds every test in this file, to keep it fast.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cluster_fl.distributed import bitwise_differences, run_parity
from cluster_fl.secure_sum import SecureSummer, decode, encode

SHAPES = {"enc.q.lora_A": (4, 8), "dec.v.lora_B": (16,), "stat": 3, "n_clients": 1}
BOUNDS = {"enc.q.lora_A": 1.0, "dec.v.lora_B": 1.0, "stat": 2.0, "n_clients": 1.0}
N_CLIENTS, ROUNDS, FRAC_BITS = 7, 2, 32
AUDIT_NUMEL, AUDIT_ROUNDS = 20_000, 5  # 100k coordinates per rank for the independence test
FALSE_ALARM = 1e-6  # per statistic; 2 statistics x 2 modes x 5 rank-runs -> family rate <= 2e-5


def client_update(k: int, rnd: int) -> dict[str, torch.Tensor | int]:
    """Client k's contribution in round rnd: float32 like a real clipped update."""
    g = torch.Generator().manual_seed(1000 * rnd + k)
    return {"enc.q.lora_A": torch.rand(4, 8, generator=g) * 2 - 1,
            "dec.v.lora_B": (torch.randn(16, generator=g) / 3).clamp(-1, 1),
            "stat": torch.rand(3, generator=g) * 2, "n_clients": 1}


def audit_input(rank: int, rnd: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(99_000 + 10 * rnd + rank)
    return torch.rand(AUDIT_NUMEL, generator=g) * 2 - 1


def secure_sum_worker(comm) -> dict:
    """Each rank adds its share of the clients (in reverse order), reduces, and reports."""
    out: dict = {}
    mine = [k for k in range(N_CLIENTS) if k % comm.world_size == comm.rank][::-1]
    for mode in ("research", "secure"):
        s = SecureSummer(SHAPES, frac_bits=FRAC_BITS, max_clients=64, bounds=BOUNDS, mode=mode,
                         seed=17, integer_fields=["n_clients"])
        sums = []
        for rnd in range(ROUNDS):
            for k in mine:
                s.add(client_update(k, rnd))
            sums.append(s.reduce(comm, rnd, record=(rnd == 0)))
            if rnd == 0:
                masked0 = s.last_partial["masked"]
        if comm.rank == 0:  # a second reduction in one round, other ranks contribute nothing
            s.add({"stat": torch.tensor([0.5, -1.25, 2.0])})
        stream1 = s.reduce(comm, ROUNDS - 1, stream=1)
        audit = SecureSummer({"x": AUDIT_NUMEL}, frac_bits=FRAC_BITS, max_clients=8, bounds=1.0,
                             mode=mode, seed=17)
        masked, plain = [], []
        for rnd in range(AUDIT_ROUNDS):
            x = audit_input(comm.rank, rnd)
            audit.add({"x": x})
            audit.reduce(comm, rnd, record=True)
            masked.append(audit.last_partial["masked"][:AUDIT_NUMEL])
            plain.append(encode(x, FRAC_BITS))
        out[mode] = {"sums": sums, "stream1": stream1, "masked0": masked0,
                     "fingerprints": s.key_fingerprints(),
                     "audit_masked": torch.cat(masked), "audit_plain": torch.cat(plain)}
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    torch.set_num_threads(1)
    return run_parity(secure_sum_worker, world_sizes=(1, 2, 3), timeout_s=90)


def expected_sums(rnd: int) -> dict[str, torch.Tensor]:
    """The plain fixed-point sum of every client, computed here in one process (int64)."""
    total: dict[str, torch.Tensor | int] = {name: 0 for name in SHAPES}
    bits = {name: 0 if name == "n_clients" else FRAC_BITS for name in SHAPES}
    for k in range(N_CLIENTS):
        for name, v in client_update(k, rnd).items():
            shape = SHAPES[name] if isinstance(SHAPES[name], tuple) else (SHAPES[name],)
            total[name] = total[name] + encode(v, bits[name]).reshape(shape)
    return {name: decode(t, bits[name]) for name, t in total.items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["research", "secure"])
def test_secure_sum_equals_plain_fixed_point_sum_exactly(runs, world, mode):
    for rank, result in enumerate(runs[world]):
        for rnd in range(ROUNDS):
            got = result[mode]["sums"][rnd]
            assert bitwise_differences(got, expected_sums(rnd)) == [], (rank, rnd)
            assert got["n_clients"].item() == N_CLIENTS
            # and it is the float sum up to the fixed-point resolution
            fsum = sum(client_update(k, rnd)["dec.v.lora_B"].double() for k in range(N_CLIENTS))
            assert torch.allclose(got["dec.v.lora_B"], fsum, rtol=0,
                                  atol=N_CLIENTS * 2.0 ** -(FRAC_BITS + 1))
        assert result[mode]["stream1"]["stat"].tolist() == [0.5, -1.25, 2.0]
        assert result[mode]["stream1"]["dec.v.lora_B"].abs().sum().item() == 0.0


def test_result_is_bit_identical_for_1_2_3_ranks_and_the_fake(runs):
    reference = runs[1][0]["research"]["sums"]  # the single-process fake
    for world in (1, 2, 3):
        for rank in range(world):
            for mode in ("research", "secure"):
                assert bitwise_differences(runs[world][rank][mode]["sums"], reference) == [], \
                    (world, rank, mode)


@pytest.mark.parametrize("mode", ["research", "secure"])
def test_recorded_masked_partials_are_what_the_all_reduce_adds(runs, mode):
    plain = sum(int(encode(client_update(k, 0)["dec.v.lora_B"], FRAC_BITS)[0])
                for k in range(N_CLIENTS))
    offset = 32  # "dec.v.lora_B" follows the 4x8 field
    for world in (2, 3):
        masked = [int(r[mode]["masked0"][offset]) for r in runs[world]]
        assert any(m != 0 for m in masked)
        assert sum(masked) % 2**64 == plain % 2**64
        # a rank's masked partial is not its plain partial
        mine = sum(int(encode(client_update(k, 0)["dec.v.lora_B"], FRAC_BITS)[0])
                   for k in range(0, N_CLIENTS, world))
        assert masked[0] != mine


def test_secure_mode_keys_agree_per_pair_and_differ_between_runs(runs):
    fp2 = [r["secure"]["fingerprints"] for r in runs[2]]
    fp3 = [r["secure"]["fingerprints"] for r in runs[3]]
    assert fp2[0][1] == fp2[1][0]
    assert fp3[0][1] == fp3[1][0] and fp3[0][2] == fp3[2][0] and fp3[1][2] == fp3[2][1]
    assert len({fp3[0][1], fp3[0][2], fp3[1][2]}) == 3
    assert fp2[0][1] != fp3[0][1]  # fresh X25519 keypairs every run
    assert runs[2][0]["research"]["fingerprints"] == {}  # research mode has no secret keys
    # research masks are reproducible from the seed, secure ones are not
    assert not torch.equal(runs[2][0]["secure"]["masked0"], runs[2][0]["research"]["masked0"])


def correlation_alarm(masked: torch.Tensor, plain: torch.Tensor) -> dict[str, float]:
    """Two independence statistics with their null-distribution bounds at FALSE_ALARM:
    Pearson r between input and masked value (as a uniform in [0,1)); sqrt(n)·r ~ N(0,1) under
    independence; and a chi-square test that the masked value's top byte is uniform."""
    import scipy.stats  # here, not at module level: spawned ranks import this module

    u = masked.numpy().view(np.uint64).astype(np.float64) / 2.0**64
    x = plain.numpy().astype(np.float64)
    n = u.size
    r = float(np.corrcoef(u, x)[0, 1])
    r_bound = scipy.stats.norm.isf(FALSE_ALARM / 2) / math.sqrt(n)
    counts = np.bincount((masked.numpy().view(np.uint64) >> np.uint64(56)).astype(np.int64),
                         minlength=256)
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    return {"r": r, "r_bound": r_bound, "chi2": chi2,
            "chi2_bound": float(scipy.stats.chi2.isf(FALSE_ALARM, 255))}


@pytest.mark.parametrize("mode", ["research", "secure"])
def test_a_ranks_masked_contribution_is_uncorrelated_with_its_input(runs, mode):
    for world in (2, 3):
        for rank, result in enumerate(runs[world]):
            s = correlation_alarm(result[mode]["audit_masked"], result[mode]["audit_plain"])
            assert abs(s["r"]) < s["r_bound"], (world, rank, s)
            assert s["chi2"] < s["chi2_bound"], (world, rank, s)
    # positive control: with one rank there is nothing to mask, and the same test must fire
    s = correlation_alarm(runs[1][0][mode]["audit_masked"], runs[1][0][mode]["audit_plain"])
    assert abs(s["r"]) > 10 * s["r_bound"] and s["chi2"] > s["chi2_bound"]

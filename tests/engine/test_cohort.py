"""Research-mode cohort sampling (engine/cohort.py): what the accountant assumes of it.

The ledger charges Poisson sampling at q = m/N (or m of N without replacement) with a fresh draw
every round; these tests hold the sampler to that, statistically (bounds at ≥ 6 standard
deviations: false alarms are negligible) and exactly where it is deterministic.
"""

from __future__ import annotations

import math

from cluster_fl.engine.cohort import denominator, sample_cohort, sampling_rate

N, M, ROUNDS = 50, 10, 400


def test_poisson_includes_each_client_at_rate_q_afresh_every_round():
    q = sampling_rate(M, N)
    assert q == 0.2
    cohorts = [sample_cohort(7, r, N, M, "poisson") for r in range(1, ROUNDS + 1)]
    assert cohorts[0] == sample_cohort(7, 1, N, M, "poisson")  # a function of (seed, round)
    assert cohorts[0] != sample_cohort(8, 1, N, M, "poisson")
    for c in cohorts:
        assert c == sorted(set(c)) and all(0 <= i < N for i in c)
    # the realised size varies (Poisson sampling), around q·N
    sizes = [len(c) for c in cohorts]
    assert len(set(sizes)) > 3
    sd = math.sqrt(N * q * (1 - q) / ROUNDS)
    assert abs(sum(sizes) / ROUNDS - q * N) < 6 * sd
    # every client at rate q
    per_client = math.sqrt(q * (1 - q) / ROUNDS)
    for i in range(N):
        rate = sum(i in c for c in cohorts) / ROUNDS
        assert abs(rate - q) < 6 * per_client, (i, rate)
    # fresh every round: consecutive cohorts share q² of the clients on average, not all
    shared = [len(set(a) & set(b)) for a, b in zip(cohorts, cohorts[1:])]
    assert sum(shared) / len(shared) < 2 * q * q * N
    assert len({tuple(c) for c in cohorts}) > ROUNDS * 0.9


def test_fixed_draws_exactly_m_distinct_clients_afresh_every_round():
    cohorts = [sample_cohort(7, r, N, M, "fixed") for r in range(1, ROUNDS + 1)]
    for c in cohorts:
        assert len(c) == M and c == sorted(set(c)) and all(0 <= i < N for i in c)
    q = M / N
    per_client = math.sqrt(q * (1 - q) / ROUNDS)
    for i in range(N):
        assert abs(sum(i in c for c in cohorts) / ROUNDS - q) < 6 * per_client
    assert len({tuple(c) for c in cohorts}) > ROUNDS * 0.9
    assert sample_cohort(7, 3, 4, 9, "fixed") == [0, 1, 2, 3]  # m > N: everyone


def test_the_denominator_is_public_the_expected_not_the_realised_size():
    assert denominator(M, N, "poisson") == 10.0 and denominator(M, N, "fixed") == 10.0
    assert denominator(9, 4, "fixed") == 4.0 and denominator(9, 4, "poisson") == 4.0

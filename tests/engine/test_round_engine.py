"""The round engine with a fake client runner: sensitivity, noise once, non-finite clients.

A test double for ``ClientRunner`` returns crafted updates, so these tests isolate what the engine
does between local training and the new global state: clip (alpha-split pools), exact secure sum,
Gaussian noise added once on rank 0 with the public denominator, server step.

- One client scaled by 1e6 moves the noiseless aggregate by at most its share √α_k·C/n per pool
  (and C/n in total); without privacy the same client moves it by orders of magnitude more.
- With zero updates the released mean is pure noise: its empirical variance matches σ²C²/n² for
  1 process and for 2 gloo ranks (χ² interval, false-alarm rate 1e-6 per check), and the 2-rank
  release is bit-identical to the 1-process one -- which rules out noise drawn on every rank
  (that would be 2σ²C²/n², far outside the interval). At C = 0.5 too, where a noise std of σ
  instead of σ·C would show as a variance 4x too large.
- No rank receives the clean sum: what each of 2 gloo ranks decodes from the secure-sum
  all-reduce is the noised total, identical on both ranks and to 1 process, and differs from
  the clean sum of the clipped updates in every coordinate by N(0, σ²C²).
- A NaN/Inf client contributes exactly zero and is counted in ``n_nonfinite``.
- Adaptive policies (EMA, quantile, and the paper's non-private EMA) run and adapt.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import (FAKE_GROUPS, FakeRunner, chi2_interval, engine_config, flat,
                            make_engine, noise_worker, norm, random_update, received_worker,
                            zero_state)

from cluster_fl.distributed import LocalComm, bitwise_differences, spawn

N = 5  # cohort size (fixed sampling over 5 clients: everyone, every round)
POOLS = {"encoder": ["enc.q.A", "enc.q.B"], "decoder": ["conn.w", "dec.v.B"]}
FALSE_ALARM = 1e-6
FIXED_POINT_SLACK = 1e-8  # |decoded - exact| over all coordinates, 32 fractional bits


def _mean_update(cfg_extra: tuple[str, ...], make) -> tuple[dict, dict]:
    cfg = engine_config(f"fl.clients_per_round={N}", *cfg_extra)
    engine = make_engine(cfg, FakeRunner(make), N)
    out = engine.run_round(1, zero_state())
    return out.state, out.row  # zero start state + server_lr 1: the new state IS the mean update


def _attacked(scale: float, victim: int = 2):
    def make(c: int, r: int) -> dict:
        u = random_update(c, r, scale=1e-4)
        return {k: v * (1e6 if c == victim else 1.0) for k, v in u.items()} if scale else u
    return make


@pytest.mark.parametrize("alpha", [0.25, 0.05])
def test_one_client_scaled_by_1e6_moves_each_pool_by_at_most_its_share(alpha):
    extra = ("privacy.noise_multiplier=0", f"privacy.alpha={alpha}")
    base, _ = _mean_update(extra, _attacked(0))
    hit, _ = _mean_update(extra, _attacked(1))
    names = [g.name for g in FAKE_GROUPS]
    moved = {pool: norm(flat(hit, groups) - flat(base, groups)) for pool, groups in POOLS.items()}
    share = {"encoder": alpha, "decoder": 1 - alpha}
    for pool, m in moved.items():
        bound = math.sqrt(share[pool]) * 1.0 / N
        assert m <= bound + FIXED_POINT_SLACK, (pool, m, bound)
        assert m >= 0.95 * bound, (pool, m, bound)  # tight: the clipped client sits at its share
    assert norm(flat(hit, names) - flat(base, names)) <= 1.0 / N + FIXED_POINT_SLACK


def test_without_privacy_the_same_client_moves_the_aggregate_far_beyond_c_over_n():
    """Negative control: the bound above comes from clipping, not from the test's inputs."""
    extra = ("privacy.mechanism=none",)
    base, _ = _mean_update(extra, _attacked(0))
    hit, _ = _mean_update(extra, _attacked(1))
    names = [g.name for g in FAKE_GROUPS]
    assert norm(flat(hit, names) - flat(base, names)) > 100 * 1.0 / N


@pytest.fixture(scope="module")
def noise_runs():
    sigma, rounds = 0.7, 2
    one = noise_worker(LocalComm(), N, sigma, rounds)
    two = spawn(noise_worker, 2, N, sigma, rounds, timeout_s=120)
    return sigma, one, two


def test_released_mean_of_zero_updates_has_variance_sigma2_c2_over_n2_once(noise_runs):
    sigma, one, two = noise_runs
    expected = (sigma * 1.0 / N) ** 2
    lo, hi = chi2_interval(one["means"].numel(), FALSE_ALARM)
    assert hi < 2.0  # the interval separates "noise once" from "noise on each of 2 ranks"
    for name, run in (("1 process", one), ("2 ranks, rank 0", two[0]), ("2 ranks, rank 1", two[1])):
        assert run["denominator"] == N
        ratio = float((run["means"] ** 2).mean()) / expected
        assert lo < ratio < hi, (name, ratio, lo, hi)


def test_released_noise_scales_with_the_clip_norm_at_c_one_half():
    sigma, c = 0.7, 0.5
    run = noise_worker(LocalComm(), N, sigma, 2, clip_norm=c)
    lo, hi = chi2_interval(run["means"].numel(), FALSE_ALARM)
    assert 0.25 < lo and hi < 4.0  # separates std σ·C from std σ (variance x 1/C² = 4)
    ratio = float((run["means"] ** 2).mean()) / (sigma * c / N) ** 2
    assert lo < ratio < hi, (ratio, lo, hi)


def test_no_rank_receives_the_clean_sum_only_the_noised_total():
    sigma, c = 0.8, 0.5
    clean = received_worker(LocalComm(), N, 0.0)["received"][0]
    one = received_worker(LocalComm(), N, sigma)
    two = spawn(received_worker, 2, N, sigma, timeout_s=120)
    assert all(len(run["received"]) == 1 for run in (one, *two))  # one all-reduce a round
    names = [g.name for g in FAKE_GROUPS]
    for rank, run in enumerate(two):
        got = run["received"][0]
        assert bitwise_differences(got, one["received"][0]) == [], rank
        resid = flat(got, names) - flat(clean, names)
        assert bool((resid != 0).all()), rank  # the noise is in every coordinate received
        lo, hi = chi2_interval(resid.numel(), FALSE_ALARM)
        assert lo < float((resid ** 2).mean()) / (sigma * c) ** 2 < hi, rank
        # a rank's own partial is its clients' alone: it trained some, not the whole cohort
        assert flat(run["partials"][0], names).abs().sum() > 0
    assert bitwise_differences(one["mean"], two[1]["mean"]) == []


def test_two_ranks_split_the_cohort_and_release_the_same_noise_as_one_process(noise_runs):
    _, one, two = noise_runs
    assert one["trained"] == sorted(two[0]["trained"] + two[1]["trained"])
    assert two[0]["trained"] and two[1]["trained"], "the cohort was not split over the ranks"
    assert bitwise_differences(two[0]["means"], two[1]["means"]) == []
    assert bitwise_differences(one["means"], two[0]["means"]) == []


def test_grid_cells_that_share_a_seed_never_share_noise():
    """Research noise is scoped by the run id: two methods with one seed (two cells of a grid)
    draw independent noise -- the difference of their releases is no exact difference of sums --
    while the same cell reproduces its own bit for bit."""
    from engine_helpers import BIG_GROUPS

    def released(method):
        cfg = engine_config(f"privacy.clipping={method}", "run.seed=4", "privacy.noise_multiplier=1",
                            f"fl.clients_per_round={N}")
        zero = FakeRunner(lambda c, r: {s.name: torch.zeros(s.shape) for s in BIG_GROUPS})
        engine = make_engine(cfg, zero, N, groups=BIG_GROUPS)
        state = {s.name: torch.zeros(s.shape, dtype=torch.float64) for s in BIG_GROUPS}
        return flat(engine.run_round(1, state).state, [s.name for s in BIG_GROUPS])

    flat_a, flat_b, size = released("flat"), released("flat"), released("size")
    assert torch.equal(flat_a, flat_b)
    # |corr| of 12,000 independent pairs above 0.05 has probability < 1e-6
    assert abs(float(torch.corrcoef(torch.stack([flat_a, size]))[0, 1])) < 0.05


def test_noise_is_fresh_per_round(noise_runs):
    _, one, _ = noise_runs
    assert not torch.equal(one["means"][0], one["means"][1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("mechanism", ["gaussian", "none"])
def test_a_non_finite_client_contributes_zero_and_is_counted(bad, mechanism):
    victim = 3

    def make(poisoned: bool):
        def f(c: int, r: int) -> dict:
            u = random_update(c, r)
            if c == victim:
                u = {k: torch.zeros_like(v) for k, v in u.items()}
                if poisoned:
                    u["dec.v.B"][4] = bad
            return u
        return f

    extra = ("privacy.noise_multiplier=0", "privacy.diagnostics=exact",
             f"privacy.mechanism={mechanism}")
    poisoned, row = _mean_update(extra, make(True))
    assert row["n_nonfinite"] == 1 and row["n_clients"] == N
    assert all(torch.isfinite(v).all() for v in poisoned.values())
    if mechanism == "gaussian":  # the public denominator stays n: exactly a zero contribution
        zeroed, zrow = _mean_update(extra, make(False))
        assert zrow["n_nonfinite"] == 0
        assert bitwise_differences(poisoned, zeroed) == []
    else:  # plain FedAvg averages over the clients that contributed
        names = [g.name for g in FAKE_GROUPS]
        others = sum(flat(random_update(c, 1), names) for c in range(N) if c != victim)
        assert torch.allclose(flat(poisoned, names), others / (N - 1), atol=1e-8, rtol=0)


@pytest.mark.parametrize("clipping,adaptive_private", [("size-ema", True), ("size-ema", False),
                                                       ("quantile", True)])
def test_adaptive_policies_run_and_move_their_thresholds(clipping, adaptive_private):
    """Including the paper's non-private EMA, whose unbounded statistic must still fit the sum."""
    cfg = engine_config(f"fl.clients_per_round={N}", f"privacy.clipping={clipping}",
                        f"privacy.adaptive_private={str(adaptive_private).lower()}",
                        "privacy.ema_warmup_rounds=0")
    engine = make_engine(cfg, FakeRunner(random_update), N)
    state, thresholds = zero_state(), []
    for r in (1, 2, 3):
        out = engine.run_round(r, state)
        state = out.state
        thresholds.append({k: v for k, v in out.row.items() if k.startswith("threshold/")})
    assert thresholds[0] and thresholds[0] != thresholds[-1]
    assert all(math.isfinite(v) for t in thresholds for v in t.values())


@pytest.mark.parametrize("diagnostics", ["noised", "exact"])
def test_a_round_row_has_the_run_folder_columns(diagnostics):
    """COMMON run-folder format: per pool clip_rate/retained/mean_norm/threshold, per group
    threshold (and norm/G with exact diagnostics), totals and counters."""
    alpha = 0.25
    _, row = _mean_update((f"privacy.diagnostics={diagnostics}", f"privacy.alpha={alpha}"),
                          random_update)
    need = {"round", "loss", "n_clients", "n_skipped", "n_nonfinite", "total_norm", "clip_rate",
            "denominator"}
    for pool in POOLS:
        need |= {f"{k}/{pool}" for k in ("clip_rate", "retained", "mean_norm", "threshold")}
    need |= {f"threshold/{g.name}" for g in FAKE_GROUPS}
    if diagnostics == "exact":
        need |= {f"norm/{g.name}" for g in FAKE_GROUPS}
    assert need <= set(row), sorted(need - set(row))
    # exact facts of the round never enter the released row (the operator log has them)
    assert not {"n_cohort", "empty", "wall_s"} & set(row)
    assert row["threshold/encoder"] == pytest.approx(math.sqrt(alpha))
    assert row["threshold/decoder"] == pytest.approx(math.sqrt(1 - alpha))
    if diagnostics == "exact":
        assert row["n_clients"] == N and row["n_skipped"] == 0
        names = [g.name for g in FAKE_GROUPS]
        exact = sum(norm(random_update(c, 1)[n]) for c in range(N) for n in names[:1]) / N
        assert row[f"norm/{names[0]}"] == pytest.approx(exact, rel=1e-9)


def test_a_client_without_usable_audio_is_skipped_and_counted():
    from engine_helpers import fake_clients

    clients = fake_clients(N)
    clients[1].utterances = []
    cfg = engine_config(f"fl.clients_per_round={N}", "privacy.diagnostics=exact",
                        "privacy.noise_multiplier=0")
    runner = FakeRunner(random_update)
    out = make_engine(cfg, runner, N, clients=clients).run_round(1, zero_state())
    assert sorted(c for c, _ in runner.calls) == [0, 2, 3, 4]
    assert out.row["n_skipped"] == 1 and out.row["n_clients"] == N - 1

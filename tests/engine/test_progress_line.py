"""The per-round log line, built from the released row only: noised diagnostics are shown clamped
to their range with their ±, or named as too noisy to show when the noise spans half the range;
the client count shown is the noised one (never the realised cohort); exact ones as they are;
none with ``privacy.diagnostics: off``; never a wall time."""

from __future__ import annotations

from cluster_fl.engine.metrics import progress_line


def _row(**kw):
    # n_cohort / wall_s are what older rows carried: a line must not show them even if present
    return {"n_cohort": 24, "wall_s": 1.25, "epsilon": 10.3, "denominator": 24.0, **kw}


def test_a_noised_rate_is_clamped_to_zero_one_with_its_plus_minus():
    line = progress_line(2, 3, _row(diagnostics="noised", loss=-1.277, clip_rate=1.76,
                                    n_clients=27.4, diag_noise_std=0.12))
    assert "clip rate 1.00 ± 0.12" in line and "loss 0.00 ± 1.20" in line
    assert "1.76" not in line and "-1.277" not in line and "noised" in line


def test_the_client_count_shown_is_the_noised_one_with_its_plus_minus():
    line = progress_line(2, 3, _row(diagnostics="noised", loss=1.0, clip_rate=0.5,
                                    n_clients=27.4, diag_noise_std=0.12))
    assert "clients 27 ± 2.9" in line  # 0.12 per mean x the public denominator 24
    assert "clients 24" not in line and "24" not in line.replace("± 2.9", "")
    noisy = progress_line(2, 3, _row(diagnostics="noised", loss=1.0, clip_rate=0.5,
                                     n_clients=27.4, diag_noise_std=0.6))
    assert "27" not in noisy and "clients" in noisy.split("noised", 1)[1] and "too noisy" in noisy


def test_a_noised_figure_whose_noise_spans_half_its_range_is_not_shown():
    line = progress_line(1, 3, _row(diagnostics="noised", loss=3.1, clip_rate=0.4,
                                    n_clients=24.0, diag_noise_std=0.72))
    assert "0.40" not in line and "3.1" not in line
    assert "noised loss, clients, clip rate: too noisy to show" in line


def test_exact_diagnostics_are_shown_as_they_are_and_off_shows_none():
    exact = progress_line(1, 3, _row(diagnostics="exact", loss=1.277, clip_rate=0.76,
                                     n_clients=23.0))
    assert "loss 1.277" in exact and "clip rate 0.76" in exact and "clients 23" in exact
    assert "±" not in exact
    off = progress_line(1, 3, _row(diagnostics="off"))
    assert "diagnostics off" in off and "loss" not in off and "clip" not in off
    assert "clients" not in off and "24" not in off


def test_no_line_shows_a_wall_time():
    for mode in ("noised", "exact", "off"):
        line = progress_line(1, 3, _row(diagnostics=mode, loss=1.0, clip_rate=0.5,
                                        n_clients=24.0, diag_noise_std=0.1))
        assert "1.2s" not in line and "1.25" not in line and "s," not in line, line


def test_an_evaluated_round_shows_its_test_wer_first_on_the_same_line():
    line = progress_line(3, 12, _row(diagnostics="off"), evaluated="test WER 0.912 (240 utterances)")
    assert line == "round 3/12: test WER 0.912 (240 utterances), eps 10.3 (diagnostics off)"

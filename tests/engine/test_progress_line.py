"""The per-round log line: noised diagnostics are shown clamped to their range with their ±, or
left out (naming their ±) when the noise spans half the range; exact ones as they are; none with
``privacy.diagnostics: off``."""

from __future__ import annotations

from cluster_fl.engine.metrics import progress_line


def _row(**kw):
    return {"n_cohort": 24, "epsilon": 10.3, "wall_s": 1.2, **kw}


def test_a_noised_rate_is_clamped_to_zero_one_with_its_plus_minus():
    line = progress_line(2, 3, _row(diagnostics="noised", loss=-1.277, clip_rate=1.76,
                                    diag_noise_std=0.12))
    assert "clip rate 1.00 ± 0.12" in line and "loss 0.00 ± 1.20" in line
    assert "1.76" not in line and "-1.277" not in line and "noised" in line


def test_a_noised_figure_whose_noise_spans_half_its_range_is_not_shown():
    line = progress_line(1, 3, _row(diagnostics="noised", loss=3.1, clip_rate=0.4,
                                    diag_noise_std=0.72))
    assert "0.40" not in line and "3.1" not in line
    assert "clip rate ± 0.72" in line and "loss ± 7.2" in line and "too noisy" in line


def test_exact_diagnostics_are_shown_as_they_are_and_off_shows_none():
    exact = progress_line(1, 3, _row(diagnostics="exact", loss=1.277, clip_rate=0.76))
    assert "loss 1.277" in exact and "clip rate 0.76" in exact and "±" not in exact
    off = progress_line(1, 3, _row(diagnostics="off"))
    assert "diagnostics off" in off and "loss" not in off and "clip" not in off

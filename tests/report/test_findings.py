"""The pre-registered findings' rules (cluster_fl/report/findings.py, PROTOCOL §1): each
rule on rows at and around its thresholds, and the findings table read from the csv files
``launch/repro_results.sh`` writes (a grid still running is marked interim, a missing
comparison "not run yet")."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from cluster_fl.report import findings as fd

COLUMNS = ["arch", "condition", "method", "reference", "seeds", "n_seeds", "n_speakers",
           "delta_wer", "ci_low", "ci_high", "test", "p", "p_holm", "p_sign_flip_exact",
           "level", "correction", "comparisons", "verdict"]


def row(method: str = "m", delta: float = 0.0, lo: float = -0.01, hi: float = 0.01,
        verdict: str = "within noise", n: int = 5, reference: str = "flat",
        p: float = float("nan")) -> fd.Row:
    # a Holm p that agrees with the verdict (the rules check the verdict against Δ and p)
    return fd.Row("heavy", method, reference, n, delta, lo, hi,
                  0.5 if verdict == "within noise" else 0.01, verdict, 9, p)


@pytest.mark.parametrize("fid", ["L", "b1", "b2"])
def test_a_collapse_or_learning_finding_needs_worse(fid: str) -> None:
    assert fd.outcome(fid, row(verdict="worse", delta=0.1, lo=0.05, hi=0.15)) == "reproduced"
    assert fd.outcome(fid, row(verdict="within noise")) == "not reproduced"
    assert fd.outcome(fid, row(verdict="better", delta=-0.1, lo=-0.15, hi=-0.05)) == "not reproduced"


@pytest.mark.parametrize("lo, hi, verdict, expected", [
    (-0.019, 0.019, "within noise", "reproduced"),     # inside the margin
    (-0.019, 0.021, "within noise", "inconclusive"),   # crosses +0.02
    (-0.025, 0.010, "within noise", "inconclusive"),   # crosses -0.02
    (-0.015, -0.005, "better", "reproduced"),          # better, but inside the margin
    (-0.060, -0.030, "better", "not reproduced"),      # better beyond the margin
    (0.005, 0.015, "worse", "not reproduced"),         # worse, however small
    (-0.010, 0.020, "within noise", "inconclusive"),   # the margin itself is outside
])
def test_finding_c_is_an_equivalence_test(lo, hi, verdict, expected) -> None:
    assert fd.outcome("c", row(delta=(lo + hi) / 2, lo=lo, hi=hi, verdict=verdict)) == expected


@pytest.mark.parametrize("lo, hi, verdict, expected", [
    (-0.05, 0.019, "within noise", "reproduced"),
    (-0.05, -0.02, "better", "reproduced"),
    (-0.01, 0.03, "within noise", "inconclusive"),
    (0.01, 0.03, "worse", "not reproduced"),
])
def test_finding_d_is_a_non_inferiority_test(lo, hi, verdict, expected) -> None:
    assert fd.outcome("d", row(delta=(lo + hi) / 2, lo=lo, hi=hi, verdict=verdict)) == expected


def test_no_rule_for_a_descriptive_finding() -> None:
    with pytest.raises(ValueError):
        fd.outcome("a", row())


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})


def _rec(method: str, delta: float, lo: float, hi: float, verdict: str, n: int = 5,
         reference: str = "flat", comparisons: int = 9, p: float = 0.5) -> dict:
    return {"method": method, "reference": reference, "n_seeds": n, "delta_wer": delta,
            "ci_low": lo, "ci_high": hi, "p_holm": 0.5 if verdict == "within noise" else 0.01,
            "verdict": verdict, "comparisons": comparisons, "p": p}


def test_the_findings_table_reads_the_study_tables(tmp_path: Path) -> None:
    _write(tmp_path / "heavy-vs-flat.csv", [
        _rec("round-0", 0.59, 0.48, 0.69, "worse"),
        _rec("fedavg", -0.04, -0.055, -0.03, "better"),
        _rec("uniform per-layer", 0.087, 0.07, 0.10, "worse"),
        _rec("size-ema per-layer", 0.001, -0.01, 0.012, "within noise"),
        _rec("alpha-split α=0.05 per-layer", 0.002, -0.01, 0.013, "within noise", n=3, p=0.8),
        _rec("alpha-split α=0.03049 per-layer", 0.01, -0.005, 0.025, "within noise"),
        _rec("size per-layer", 0.03, 0.02, 0.04, "worse", n=1),
    ])
    with (tmp_path / "heavy-norms.csv").open("w") as f:
        f.write("arch,condition,method,ratio_decoder_encoder\nx,y,flat,11.96\nx,y,uniform,12.04\n")
    _write(tmp_path / "mild-vs-flat.csv", [_rec("round-0", 0.5, 0.4, 0.6, "worse")])
    found, rest = fd.grid_findings("heavy", tmp_path)
    by = {(f.id, f.row.method if f.row else ""): f for f in found}
    assert by["L", "round-0"].outcome == "reproduced"
    assert by["b1", "uniform per-layer"].outcome == "reproduced"
    assert by["b2", "size-ema per-layer"].outcome == "not reproduced"
    # 3 seeds: the t-interval (Δ 0.002 at p 0.8, 2 df: ±0.030) crosses the margin
    assert by["c", "alpha-split α=0.05 per-layer"].outcome == "inconclusive"
    assert by["c", "alpha-split α=0.05 per-layer"].interim == "interim (3 of 5 seeds)"
    assert by["c", "alpha-split α=0.03049 per-layer"].outcome == "inconclusive"
    assert "12.0×" in by["a", ""].detail and by["a", ""].outcome == "reported"
    assert [r.method for r in rest] == ["fedavg", "size per-layer"]  # the secondary rows
    assert fd.fedavg_gain([r for r in
                           (fd.Row.from_csv("heavy", x) for x in
                            csv.DictReader((tmp_path / "heavy-vs-flat.csv").open()))]
                          ) == pytest.approx(0.63)
    mild, _ = fd.grid_findings("mild", tmp_path)  # no α-split table, no norms yet
    assert {f.id: f.outcome for f in mild} == {"a": "not run yet", "L": "reproduced",
                                                "d": "not run yet"}
    text = fd.findings_markdown(tmp_path)
    assert "| b1: uniform per-layer collapses" in text and "**reproduced** |" in text
    assert "**inconclusive** |" in text and "eurollm" not in text  # no eurollm tables
    assert "- heavy: size per-layer vs flat: Δ +0.0300" in text
    assert "worse (1 seed), interim (1 of 5 seeds)" in text and "within noise (3 seeds)" in text
    assert "FedAvg's gain over round-0: 0.6300 WER" in text


def test_a_table_with_fewer_comparisons_than_planned_is_interim(tmp_path: Path) -> None:
    """Holm's p grows with its family: a table missing methods has interim p even at 5 seeds."""
    _write(tmp_path / "mild-vs-flat.csv", [
        _rec("round-0", 0.59, 0.48, 0.69, "worse", comparisons=6),
        _rec("fedavg", -0.04, -0.055, -0.03, "better", n=3, comparisons=6)])
    found, rest = fd.grid_findings("mild", tmp_path)
    assert {f.id: f.interim for f in found}["L"] == "interim (Holm over 6 of 9 comparisons)"
    assert fd._interim("mild", rest[0]) == "interim (3 of 5 seeds; Holm over 6 of 9 comparisons)"
    _write(tmp_path / "mild-vs-flat.csv", [_rec("round-0", 0.59, 0.48, 0.69, "worse")])
    assert {f.id: f.interim for f in fd.grid_findings("mild", tmp_path)[0]}["L"] == ""
    # a table written before the column existed is judged by its seeds alone
    assert fd._interim("mild", fd.Row("mild", "m", "flat", 5, 0, 0, 0, 1, "within noise")) == ""


def test_the_planned_comparisons_match_the_grids() -> None:
    """COMPARISONS is every method of each study grid but flat, plus round-0."""
    import yaml
    root = Path(__file__).resolve().parents[2] / "configs" / "grids"
    for grid, planned in fd.COMPARISONS.items():
        spec = yaml.safe_load((root / f"repro-{grid}.yaml").read_text())
        assert len(spec["axes"]["method"]) == planned, grid   # (methods - flat) + round-0


def test_no_tables_says_so(tmp_path: Path) -> None:
    assert fd.findings_markdown(tmp_path).startswith("No comparison tables yet")


def test_with_fewer_than_five_seeds_c_judges_the_t_interval_recovered_from_delta_and_p():
    # the study's EuroLLM α-split row: a 3-seed bootstrap CI inside ±0.02, its t-interval not
    r = fd.Row("eurollm", "alpha-split", "flat", 3, 0.0009689922480620155, -0.012194801335158278,
               0.012649723834195723, 1.0, "within noise", 5, 0.8696803247124265)
    low, high = r.t_interval()
    assert low == pytest.approx(-0.02146, abs=5e-5) and high == pytest.approx(0.02340, abs=5e-5)
    assert r.interval()[2] == "t" and fd.outcome("c", r) == "inconclusive"
    five = fd.Row("heavy", "alpha-split", "flat", 5, 0.00097, -0.0122, 0.0126, 1.0, "within noise",
                  9, 0.87)
    assert five.interval() == (-0.0122, 0.0126, "bootstrap") and fd.outcome("c", five) == "reproduced"


def test_the_t_interval_is_the_paired_tests_own():
    from scipy import stats

    diffs = [0.011, -0.004, 0.007]
    res = stats.ttest_1samp(diffs, 0.0)
    r = fd.Row("eurollm", "m", "flat", 3, sum(diffs) / 3, -1, 1, 1.0, "within noise", 5, res.pvalue)
    lo, hi = res.confidence_interval(0.95)
    assert r.t_interval() == pytest.approx((lo, hi))


def test_a_verdict_column_that_contradicts_delta_and_p_is_not_trusted(tmp_path):
    wrong = fd.Row("heavy", "uniform", "flat", 5, 0.09, 0.07, 0.1, 0.0002, "within noise", 9, 0.0001)
    assert wrong.checked_verdict == "worse" and fd.outcome("b1", wrong) == "reproduced"
    claims_worse = fd.Row("heavy", "alpha-split", "flat", 5, 0.001, -0.01, 0.01, 1.0, "worse", 9, 0.9)
    assert fd.outcome("c", claims_worse) == "reproduced"
    better = fd.Row("heavy", "fedavg", "flat", 5, -0.04, -0.05, -0.03, 0.002, "worse", 9, 0.001)
    assert better.checked_verdict == "better"
    _write(tmp_path / "heavy-vs-flat.csv", [{**_rec("uniform per-layer", 0.09, 0.07, 0.1, "worse"),
                                             "verdict": "within noise", "p_holm": 0.0002}])
    assert "worse (the table says within noise: does not match Δ and p)" in fd.findings_markdown(tmp_path)

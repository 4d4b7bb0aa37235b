"""The paired comparison behind "significantly worse" (`table --against`): the seed-level test and
the hierarchical CI it reports (their false-alarm rate and power are in test_study_stats.py), Holm across
the table, its agreement with the WER table, what it prints, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from cluster_fl.errors import UserError
from cluster_fl.report.compare import Comparison, compare, paired_test, verdict
from cluster_fl.report.results import find_runs
from cluster_fl.report.table import summarise

from cluster_fl.report.stats import holm
from fakes import write_run


def test_paired_test_is_the_seed_level_t_test_with_a_hierarchical_ci():
    """paired_test (what `table --against` runs) takes its p from the paired t-test over the
    per-seed WER differences, and its CI from the hierarchical bootstrap: on a planted +0.08
    with per-seed random effects (test_study_stats.simulate) both find it, with its sign."""
    from scipy import stats as scipy_stats

    from test_study_stats import seed_differences, simulate

    rng = np.random.default_rng(3)
    (ea, eb), w = simulate(rng, (0.0, 0.08))
    res = paired_test(ea, eb, w, resamples=2000)
    d = seed_differences(ea, eb, w)
    assert res.delta == pytest.approx(d.mean())
    assert res.p == pytest.approx(scipy_stats.ttest_1samp(d, 0.0).pvalue)
    assert res.test == "paired t, 5 seeds" and res.p < 0.01 and res.ci_low > 0
    assert res.p_sign_flip == pytest.approx(2 / 32)  # five positive seeds: the exact test's floor
    back = paired_test(eb, ea, w, resamples=2000)
    assert back.delta == pytest.approx(-res.delta) and back.ci_high < 0
    assert back.p == pytest.approx(res.p)  # two-sided


def test_one_seed_falls_back_to_a_speaker_test_and_says_so():
    from test_study_stats import simulate

    rng = np.random.default_rng(4)
    (ea, eb), w = simulate(rng, (0.0, 0.08), seeds=1)
    res = paired_test(ea, eb, w, resamples=2000)
    assert res.test == "sign-flip over 32 speakers (1 seed)"
    assert res.p < 0.01 and np.isnan(res.p_sign_flip)


def test_the_verdict_reads_the_holm_adjusted_p_two_sided():
    base = dict(arch="a", condition="c", reference="flat", method="m", seeds=[0, 1, 2, 3, 4],
                speakers=32, ci_low=0.0, ci_high=0.0, test="paired t, 5 seeds", p_sign_flip=0.06)
    assert verdict(Comparison(**base, delta=0.02, p=0.01, p_holm=0.04)) == "worse"
    assert verdict(Comparison(**base, delta=-0.02, p=0.01, p_holm=0.04)) == "better"
    # significant before the correction, not after it
    assert verdict(Comparison(**base, delta=0.02, p=0.01, p_holm=0.06)) == "within noise"


def _rows(rng, rates, words=20):
    return [{"utt_id": f"u{s}", "speaker": f"spk{s}", "language": "en", "ref": "x", "hyp": "x",
             "word_errors": int(rng.binomial(words, r)), "ref_words": words, "char_errors": 0,
             "ref_chars": 1} for s, r in enumerate(rates)]


def _study(tmp_path, shift, seeds=(0, 1, 2)):
    rng = np.random.default_rng(0)
    rates = rng.uniform(0.1, 0.5, size=24)
    for seed in seeds:
        for method, d in (("flat", 0.0), ("uniform", shift), ("size", 0.0)):
            rows = _rows(rng, np.clip(rates + d, 0, 1))
            wer = sum(r["word_errors"] for r in rows) / sum(r["ref_words"] for r in rows)
            write_run(tmp_path / f"{method}_s{seed}", method=method, seed=seed, wer=wer,
                      eval_rows=rows)
    return find_runs([tmp_path])


def test_compare_pairs_runs_by_seed_and_agrees_with_the_wer_table(tmp_path):
    runs = _study(tmp_path, shift=0.3)
    rows = {c.method: c for c in compare(runs, "flat", resamples=2000)}
    cells = {c.method: c for c in summarise(runs, resamples=200)}
    assert set(rows) == {"uniform", "size"}
    for m in rows:
        assert rows[m].delta == pytest.approx(cells[m].mean - cells["flat"].mean, abs=1e-12)
        assert rows[m].seeds == [0, 1, 2] and rows[m].speakers == 24
    assert verdict(rows["uniform"]) == "worse"
    assert verdict(rows["size"]) == "within noise"  # no planted difference
    # Holm over the table's two comparisons
    ordered = compare(runs, "flat", resamples=2000)
    assert [c.p_holm for c in ordered] == pytest.approx(holm([c.p for c in ordered]))


def test_compare_refuses_what_does_not_pair(tmp_path):
    runs = _study(tmp_path / "a", shift=0.0)
    write_run(tmp_path / "b" / "uniform_s9", method="uniform", seed=9, wer=0.3)
    write_run(tmp_path / "b" / "flat_s8", method="flat", seed=8, wer=0.3)
    with pytest.raises(UserError, match="no seed in common"):
        compare(find_runs([tmp_path / "b"]), "flat")
    with pytest.raises(UserError, match="--against nothing"):
        compare(runs, "nothing")


def test_a_grid_still_running_pairs_the_seeds_both_methods_have(tmp_path):
    runs = _study(tmp_path, shift=0.3)
    partial = [r for r in runs if not (r.method == "uniform" and r.seed == 2)]
    rows = {c.method: c for c in compare(partial, "flat", resamples=500)}
    assert rows["uniform"].seeds == [0, 1] and rows["size"].seeds == [0, 1, 2]
    assert rows["uniform"].speakers == 24 and rows["uniform"].test == "paired t, 2 seeds"


def test_table_against_prints_the_paired_table_and_refuses_latex(tmp_path, capsys):
    from cluster_fl.cli import main

    _study(tmp_path, shift=0.3)
    assert main(["table", str(tmp_path), "--against", "flat"]) == 0
    out = capsys.readouterr().out
    assert "| uniform | flat |" in out and "worse" in out
    # the level, the correction, the test and n seeds x n speakers are printed
    assert "level 0.05" in out and "Holm-corrected across the 2 comparisons" in out
    assert "two-sided" in out and "| paired t, 3 seeds |" in out and "| 3 × 24 |" in out
    assert main(["table", str(tmp_path), "--against", "flat", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("arch,condition,method,reference")
    assert main(["table", str(tmp_path), "--against", "flat", "--format", "latex"]) == 2


def test_two_regimes_of_an_unfrozen_encoder_get_their_own_rows(tmp_path):
    import json

    import pyarrow.parquet as pq

    from fakes import write_table

    for name, mult in (("heavy", 0.1), ("mild", 1.0)):
        folder = write_run(tmp_path / name, method="flat", wer=0.3)
        final = pq.read_table(folder / "final.parquet").to_pylist()[0]
        final["config_json"] = json.dumps({"client": {"lr_encoder_mult": mult}})
        write_table(folder / "final.parquet", [final])
    cells = summarise(find_runs([tmp_path]), resamples=10)
    assert sorted(c.condition for c in cells) == ["unfrozen", "unfrozen enc-lr×0.1"]

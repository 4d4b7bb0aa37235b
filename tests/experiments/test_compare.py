"""The paired comparison behind "significantly worse": its false-alarm rate on null data, its
power on a planted difference, its agreement with the WER table, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from cluster_fl.errors import UserError
from cluster_fl.experiments.compare import compare, paired_test, verdict
from cluster_fl.experiments.results import find_runs
from cluster_fl.experiments.table import summarise

from fakes import write_run


def _speakers(rng, n_seeds=3, n_speakers=32, words=60, base=None, shift=0.0):
    """Per-seed speaker error counts: heterogeneous speakers (WER 0.05-0.6), binomial errors."""
    base = rng.uniform(0.05, 0.6, size=n_speakers) if base is None else base
    w = [np.full(n_speakers, float(words)) for _ in range(n_seeds)]
    e = [rng.binomial(words, np.clip(base + shift, 0, 1)).astype(float) for _ in range(n_seeds)]
    return base, e, w


def test_false_alarm_rate_on_null_data_is_at_most_the_level():
    """200 null studies (both methods draw errors from the same speaker rates), test at 0.05.
    Stated false-alarm rate of this test: with an exact 5% level the count of rejections is
    Binomial(200, 0.05) (mean 10, sd 3.1); failing above 20 happens with probability ~0.1%."""
    rng = np.random.default_rng(1234)
    rejections = 0
    for _ in range(200):
        base, ea, w = _speakers(rng)
        _, eb, _ = _speakers(rng, base=base)
        _, _, _, p_worse, _ = paired_test(ea, eb, w, resamples=1000, seed=int(rng.integers(1 << 30)))
        rejections += p_worse < 0.05
    assert rejections <= 20


def test_a_planted_difference_is_found_with_its_size_and_sign():
    rng = np.random.default_rng(7)
    base, ea, w = _speakers(rng)
    _, eb, _ = _speakers(rng, base=base, shift=0.08)
    delta, low, high, p_worse, p_better = paired_test(ea, eb, w, resamples=4000)
    assert 0.05 < delta < 0.11 and low > 0 and p_worse < 0.01 and p_better > 0.5
    delta, low, high, p_worse, p_better = paired_test(eb, ea, w, resamples=4000)
    assert delta < 0 and high < 0 and p_better < 0.01


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
        assert rows[m].seeds == [0, 1, 2] and rows[m].speakers == 72
    assert verdict(rows["uniform"]) == "worse"
    assert rows["size"].p_worse > 0.01  # no planted difference


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
    assert rows["uniform"].speakers == 48


def test_table_against_prints_the_paired_table_and_refuses_latex(tmp_path, capsys):
    from cluster_fl.cli import main

    _study(tmp_path, shift=0.3)
    assert main(["table", str(tmp_path), "--against", "flat"]) == 0
    out = capsys.readouterr().out
    assert "| uniform | flat |" in out and "worse" in out
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

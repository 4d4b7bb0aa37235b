"""The metric the study stands on, pinned as tightly as the privacy core: text normalisation on
both sides of the WER, and the speaker-clustered bootstrap interval. Each test names the slip it
catches; tests/mutants/catalog.py plants those slips and requires these tests to fail.

Normalisation (``cluster_fl.data.vocab.normalize_text``, applied by ``score_rows`` to the
reference AND the hypothesis): lowercase, Unicode NFC, punctuation removed, an apostrophe kept
only inside a word, whitespace collapsed. The interval (``bootstrap_ci``, what ``summarize``
reports as ``wer_ci_*``): speakers resampled with replacement, each resample's errors and
reference words pooled (a ratio of sums, not a mean of rates), the 2.5th and 97.5th percentiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from cluster_fl.data.vocab import normalize_text
from cluster_fl.eval import bootstrap_ci, summarize
from cluster_fl.eval.evaluate import score_rows


def _utt(text: str, speaker: str = "s0", i: int = 0) -> dict:
    return {"transcript": text, "utterance_id": f"u{i}", "speaker": speaker, "language": "en"}


@pytest.mark.parametrize("raw, normalised", [
    ("The Cat SAT", "the cat sat"),                       # case
    ("the cat, sat. on: the mat!", "the cat sat on the mat"),  # punctuation
    ("  two\tspaces \n here ", "two spaces here"),         # whitespace
    ("don't 'quoted' l'eau", "don't quoted l'eau"),        # apostrophes inside words only
    ("cafe\u0301", "caf\u00e9"),                           # NFC: e + combining acute = é
    ("snake_case", "snake case"),
])
def test_normalisation_by_rule(raw, normalised):
    assert normalize_text(raw) == normalised


def test_the_hypothesis_is_normalised_like_the_reference():
    # slip: only one side normalised -- a cased, punctuated hypothesis would count as errors
    rows = score_rows([_utt("the cat sat on the mat")], ["The Cat, sat on THE mat."])
    assert rows[0]["hyp"] == "the cat sat on the mat" and rows[0]["word_errors"] == 0
    assert summarize(rows, bootstrap=0)["wer"] == 0.0


def test_the_reference_is_normalised_like_the_hypothesis():
    rows = score_rows([_utt("Zwei, DREI vier.")], ["zwei drei vier"])
    assert rows[0]["ref"] == "zwei drei vier" and rows[0]["word_errors"] == 0
    assert rows[0]["ref_words"] == 3 and rows[0]["ref_chars"] == len("zwei drei vier")


def test_composed_and_decomposed_accents_are_the_same_word():
    rows = score_rows([_utt("caf\u00e9 cr\u00e8me")], ["cafe\u0301 cre\u0300me"])
    assert rows[0]["word_errors"] == 0 and rows[0]["char_errors"] == 0


def test_apostrophes_inside_words_count_and_quotes_do_not():
    rows = score_rows([_utt("don't stop"), _utt("l'eau", i=1)], ["dont stop", "'l'eau'"])
    assert rows[0]["word_errors"] == 1  # "dont" is another word than "don't"
    assert rows[1]["word_errors"] == 0


def _rows(per_speaker: dict[str, list[tuple[int, int]]]) -> list[dict]:
    return [{"utt_id": f"{s}-{i}", "speaker": s, "language": "en", "word_errors": e,
             "ref_words": n, "char_errors": e, "ref_chars": n}
            for s, utts in per_speaker.items() for i, (e, n) in enumerate(utts)]


# speakers of unequal size and rate: a mean of per-speaker rates differs from the pooled ratio
SPEAKERS = {"a": [(1, 10)] * 3, "b": [(9, 10)], "c": [(0, 5), (2, 5)], "d": [(4, 20)],
            "e": [(6, 8), (1, 8)]}


def _reference(rows, n: int, seed: int, cluster: str = "speaker") -> tuple[float, float]:
    """The interval as specified, written out: sums per cluster (sorted ids), clusters drawn
    with replacement, pooled ratio per draw, 2.5th / 97.5th percentiles."""
    keys = sorted({r[cluster] for r in rows})
    err = np.array([sum(r["word_errors"] for r in rows if r[cluster] == k) for k in keys], float)
    tot = np.array([sum(r["ref_words"] for r in rows if r[cluster] == k) for k in keys], float)
    idx = np.random.default_rng(seed).integers(0, len(keys), size=(n, len(keys)))
    stats = err[idx].sum(axis=1) / tot[idx].sum(axis=1)
    return tuple(float(x) for x in np.percentile(stats, [2.5, 97.5]))


def test_the_interval_is_the_specified_speaker_bootstrap_exactly():
    rows = _rows(SPEAKERS)
    assert bootstrap_ci(rows, 4000, seed=11) == pytest.approx(_reference(rows, 4000, 11), abs=1e-12)


def test_the_reported_interval_resamples_speakers_not_utterances():
    # slip: summarize's interval clustered by utterance (narrower: utterances of a speaker are
    # correlated) -- the reported CI must be the speaker bootstrap
    rows = _rows(SPEAKERS)
    s = summarize(rows, bootstrap=4000, seed=5)
    assert (s["wer_ci_low"], s["wer_ci_high"]) == pytest.approx(_reference(rows, 4000, 5), abs=1e-12)
    assert (s["wer_ci_low"], s["wer_ci_high"]) != pytest.approx(
        _reference(rows, 4000, 5, cluster="utt_id"), abs=1e-3)


def test_each_resample_pools_errors_over_words_not_a_mean_of_speaker_rates():
    # two speakers: 0 of 100 words and 1 of 1 word. Pooled over one draw of each: 1/101; a mean
    # of rates would give 0.5 for that draw. Every draw's pooled value is 0, 1/101 or 1.
    rows = _rows({"big": [(0, 100)], "small": [(1, 1)]})
    low, high = bootstrap_ci(rows, 2000, seed=0)
    assert low == 0.0 and high == 1.0
    assert summarize(rows, bootstrap=0)["wer"] == pytest.approx(1 / 101)
    mid = bootstrap_ci(rows, 2000, seed=0, level=0.4)  # 30th-70th percentile: the mixed draws
    assert mid == pytest.approx((1 / 101, 1 / 101))


def test_the_interval_is_95_percent_two_sided():
    # slip: a 90% interval (5th/95th) or one-sided tails -- 1,000 speakers of rates uniform on
    # [0, 1] with equal words: resampled means are normal with sd 0.2887/sqrt(1000)
    rng = np.random.default_rng(0)
    rows = _rows({f"s{k:04d}": [(int(e), 1000)] for k, e in enumerate(rng.integers(0, 1001, 1000))})
    mean = summarize(rows, bootstrap=0)["wer"]
    low, high = bootstrap_ci(rows, 20000, seed=1)
    sd = 0.2887 / np.sqrt(1000)
    assert (high - low) / (2 * sd) == pytest.approx(1.96, abs=0.06)
    assert (mean - low) / sd == pytest.approx(1.96, abs=0.1)
    assert (high - mean) / sd == pytest.approx(1.96, abs=0.1)


def test_draws_are_with_replacement():
    # slip: a permutation of the speakers (without replacement) -- every draw pools all speakers,
    # so the interval collapses onto the point estimate
    rows = _rows(SPEAKERS)
    low, high = bootstrap_ci(rows, 1000, seed=2)
    assert high - low > 0.05

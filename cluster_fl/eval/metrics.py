"""WER and CER (jiwer), pooled and per language, with speaker-clustered bootstrap intervals.

Error rates are pooled ratios: total edit errors over total reference words (characters), as
jiwer computes for a list of sentences, not a mean of per-utterance rates. Confidence intervals
resample SPEAKERS with replacement (cluster bootstrap) and pool the chosen speakers' errors and
reference words: utterances of one speaker are correlated (same voice, same errors), so
resampling utterances would understate the uncertainty of a test set with few speakers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Sequence

import jiwer
import numpy as np


def error_counts(ref: str, hyp: str) -> dict[str, int]:
    """Word and character edit errors of one utterance and its reference lengths."""
    words = jiwer.process_words(ref, hyp)
    chars = jiwer.process_characters(ref, hyp)
    return {
        "word_errors": words.substitutions + words.deletions + words.insertions,
        "ref_words": len(ref.split()),
        "char_errors": chars.substitutions + chars.deletions + chars.insertions,
        "ref_chars": len(ref),
    }


def _ratio(errors: float, total: float) -> float:
    return float(errors) / float(total) if total > 0 else float("nan")


def _cluster_sums(rows: Iterable[Mapping], cluster: str, errors: str, total: str
                  ) -> tuple[np.ndarray, np.ndarray]:
    err: dict = defaultdict(float)
    tot: dict = defaultdict(float)
    for r in rows:
        err[r[cluster]] += r[errors]
        tot[r[cluster]] += r[total]
    keys = sorted(err, key=str)  # sorted: the same rows in any order give the same interval
    return np.array([err[k] for k in keys]), np.array([tot[k] for k in keys])


def bootstrap_ci(rows: Sequence[Mapping], n_resamples: int, seed: int, *,
                 cluster: str = "speaker", errors: str = "word_errors",
                 total: str = "ref_words", level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the pooled error rate, resampling ``cluster`` units.

    ``cluster="speaker"`` is the speaker-clustered bootstrap; ``cluster="utt_id"`` resamples
    utterances (for comparison only). Deterministic for a seed; NaN bounds when
    ``n_resamples`` is 0 or there is nothing to resample.
    """
    if n_resamples <= 0 or not rows:
        return float("nan"), float("nan")
    err, tot = _cluster_sums(rows, cluster, errors, total)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(err), size=(n_resamples, len(err)))
    num, den = err[idx].sum(axis=1), tot[idx].sum(axis=1)
    stats = np.where(den > 0, num / np.maximum(den, 1e-12), np.nan)
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(stats, [tail, 100.0 - tail])
    return float(low), float(high)


def summarize(rows: Sequence[Mapping], bootstrap: int = 1000, seed: int = 0) -> dict[str, float]:
    """Pooled WER/CER with speaker-bootstrap 95% CIs, and WER/CER per language.

    Keys: ``wer, wer_ci_low, wer_ci_high, cer, cer_ci_low, cer_ci_high, n_utterances,
    n_speakers, wer/<lang>, cer/<lang>``.
    """
    def total(key: str, subset: Sequence[Mapping]) -> float:
        return float(sum(r[key] for r in subset))

    out: dict[str, float] = {
        "wer": _ratio(total("word_errors", rows), total("ref_words", rows)),
        "cer": _ratio(total("char_errors", rows), total("ref_chars", rows)),
        "n_utterances": len(rows),
        "n_speakers": len({r["speaker"] for r in rows}),
    }
    out["wer_ci_low"], out["wer_ci_high"] = bootstrap_ci(rows, bootstrap, seed)
    out["cer_ci_low"], out["cer_ci_high"] = bootstrap_ci(
        rows, bootstrap, seed, errors="char_errors", total="ref_chars")
    for lang in sorted({r["language"] for r in rows}):
        sub = [r for r in rows if r["language"] == lang]
        out[f"wer/{lang}"] = _ratio(total("word_errors", sub), total("ref_words", sub))
        out[f"cer/{lang}"] = _ratio(total("char_errors", sub), total("ref_chars", sub))
    return out

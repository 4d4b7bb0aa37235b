"""WER/CER equal jiwer; the bootstrap resamples speakers, is seeded, and differs from an
utterance bootstrap when a speaker's utterances are correlated."""

from __future__ import annotations

import math
import sys

import jiwer
import pytest
import torch

from cluster_fl.eval import EVAL_COLUMNS, bootstrap_ci, error_counts, evaluate, summarize

CASES = [
    (["the cat sat", "a b c d"], ["the cat sat", "a b c d"]),
    (["the cat sat on the mat", "hello world"], ["the cat sit on mat", "hello there world"]),
    (["zwei drei vier", "un deux"], ["", "un deux trois quatre"]),
    (["żółć dwa trzy", "één twee"], ["zolc dwa trzy", "een twee"]),
]


@pytest.mark.parametrize("refs,hyps", CASES)
def test_pooled_wer_and_cer_equal_jiwer(refs, hyps):
    # the run's path: per-utterance error counts, pooled by ``summarize`` (what eval.parquet and
    # final.parquet hold)
    rows = [dict(error_counts(r, h), speaker=f"s{i}", language="en")
            for i, (r, h) in enumerate(zip(refs, hyps))]
    summary = summarize(rows, bootstrap=0)
    assert summary["wer"] == pytest.approx(jiwer.wer(refs, hyps))
    assert summary["cer"] == pytest.approx(jiwer.cer(refs, hyps))
    assert summary["wer/en"] == summary["wer"]


def test_error_counts_by_hand():
    c = error_counts("the cat sat on the mat", "the cat sit on mat")
    assert (c["word_errors"], c["ref_words"]) == (2, 6)  # one substitution, one deletion
    c = error_counts("ab", "abc")
    assert (c["char_errors"], c["ref_chars"]) == (1, 2)


def _rows(per_speaker: dict[str, list[tuple[int, int]]], lang: str = "en") -> list[dict]:
    return [{"utt_id": f"{s}-{i}", "speaker": s, "language": lang, "word_errors": e,
             "ref_words": n, "char_errors": e, "ref_chars": 4 * n}
            for s, utts in per_speaker.items() for i, (e, n) in enumerate(utts)]


def test_speaker_bootstrap_is_wider_than_utterance_bootstrap_when_speakers_differ():
    # Two speakers always wrong, eight always right, 10 utterances each: utterances of one
    # speaker are perfectly correlated, so only 10 independent units exist, not 100.
    rows = _rows({f"s{k}": [(5 if k < 2 else 0, 5)] * 10 for k in range(10)})
    spk = bootstrap_ci(rows, 2000, seed=0, cluster="speaker")
    utt = bootstrap_ci(rows, 2000, seed=0, cluster="utt_id")
    assert spk[0] <= 0.2 <= spk[1] and utt[0] <= 0.2 <= utt[1]
    assert (spk[1] - spk[0]) > 2.0 * (utt[1] - utt[0])
    # A single-speaker resample has only speaker-level outcomes: 0.0 is reachable.
    assert spk[0] == 0.0 and utt[0] > 0.05


def test_bootstrap_is_deterministic_for_a_seed_and_order_free():
    rows = _rows({f"s{k}": [(k % 3, 4), (1, 6)] for k in range(7)})
    a = bootstrap_ci(rows, 500, seed=3)
    assert a == bootstrap_ci(list(reversed(rows)), 500, seed=3)
    assert a != bootstrap_ci(rows, 500, seed=4)
    assert all(math.isnan(x) for x in bootstrap_ci(rows, 0, seed=3))


def test_summary_pools_and_splits_by_language():
    rows = _rows({"a": [(1, 4)], "b": [(3, 4)]}, "en") + _rows({"c": [(0, 8)]}, "de")
    s = summarize(rows, bootstrap=200, seed=0)
    assert s["wer"] == pytest.approx(4 / 16)
    assert s["wer/en"] == pytest.approx(4 / 8) and s["wer/de"] == 0.0
    assert s["n_speakers"] == 3 and s["wer_ci_low"] <= s["wer"] <= s["wer_ci_high"]


class _Parrot(torch.nn.Module):
    """Stands in for a model in ``evaluate``: decoding is patched to echo fixed hypotheses."""


def test_evaluate_rows_follow_the_eval_parquet_layout(monkeypatch):
    ev = sys.modules["cluster_fl.eval.evaluate"]  # the module, not the function of that name

    utts = [{"features": torch.zeros(80, 10 + i), "transcript": t, "utterance_id": f"u{i}",
             "speaker": s, "language": "en"}
            for i, (t, s) in enumerate([("one two", "a"), ("three", "a"), ("four five", "b")])]
    answers = {"one two": "one two", "three": "tree", "four five": "Four"}
    caches = []

    def parrot(model, batch, n, cache, cut=None):
        caches.append(cache)
        cut.extend(t == "four five" for t in batch.texts)  # as if cut at the limit
        return [answers[t] for t in batch.texts]
    monkeypatch.setattr(ev, "greedy_decode", parrot)
    summary, rows = evaluate(_Parrot(), utts, batch_size=2, bootstrap=100, seed=0)
    assert [tuple(r) for r in rows] == [EVAL_COLUMNS] * 3
    assert [r["hyp"] for r in rows] == ["one two", "tree", "four"]  # input order, normalised
    assert summary["wer"] == pytest.approx(2 / 5)
    assert summary["hypotheses_cut"] == 1 and summary["max_new_tokens"] == 64
    assert caches == ["auto", "auto"]
    evaluate(_Parrot(), utts, batch_size=2, bootstrap=0, decode_cache="dynamic")
    assert caches[2:] == ["dynamic", "dynamic"]  # eval.decode_cache reaches the decoder


def test_evaluate_a_tiny_model_end_to_end():
    from cluster_fl.config import ModelConfig
    from cluster_fl.models import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig())
    utts = [{"features": torch.randn(80, 40 + 7 * i), "transcript": "zwei drei", "language": "de",
             "utterance_id": f"u{i}", "speaker": f"s{i % 2}"} for i in range(5)]
    summary, rows = evaluate(model, utts, batch_size=2, max_new_tokens=5, bootstrap=50, seed=1)
    assert len(rows) == 5 and all(len(r["hyp"]) <= 5 for r in rows)
    assert summary["wer"] == pytest.approx(jiwer.wer([r["ref"] for r in rows],
                                                     [r["hyp"] for r in rows]))
    assert summary == evaluate(model, utts, 3, 5, 50, 1)[0]  # batching does not matter


def test_auto_decoding_budget_is_the_longest_reference_plus_a_margin():
    from cluster_fl.eval import decode_budget
    from cluster_fl.models.tokenizer import CharTokenizer

    tok = CharTokenizer()
    refs = ["ab", "ein langer deutscher satz " * 4, "kurz"]
    longest = len(tok.encode(refs[1].strip()))
    assert decode_budget("auto", tok, refs) == longest + -(-longest // 4)
    assert decode_budget("auto", tok, ["ab"]) == 2 + 8  # at least 8 tokens of margin
    assert decode_budget(17, tok, refs) == 17  # a number is the limit as given


def test_a_cut_hypothesis_is_flagged_by_the_decoder(monkeypatch):
    from cluster_fl.config import ModelConfig
    from cluster_fl.models import build_model, decoding
    from cluster_fl.models.speech_llm import collate

    torch.manual_seed(0)
    model = build_model(ModelConfig()).eval()
    tok = model.tokenizer
    a, b = tok.encode("ab")
    eos = tok.eos_id
    # what either cache hands back: a row that ended (eos, then eos after its stop), one that
    # ended on the last slot, one that ran out of slots
    tokens = torch.tensor([[a, b, eos, eos], [a, b, a, eos], [a, b, a, b]])
    batch = collate([torch.randn(80, 40) for _ in range(3)], ["x"] * 3, ["de"] * 3)
    for cache, name in (("static", "_decode_static"), ("dynamic", "_decode_dynamic")):
        monkeypatch.setattr(decoding, name, lambda model, emb, attn, n: tokens)
        cut: list[bool] = []
        texts = decoding.greedy_decode(model, batch, 4, cache=cache, cut=cut)
        assert texts == ["ab", "aba", "abab"] and cut == [False, False, True]

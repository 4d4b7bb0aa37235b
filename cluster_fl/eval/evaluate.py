"""Evaluate a speech-LLM: batched greedy decoding, per-utterance error rows, pooled summary.

The per-utterance rows are the ``eval.parquet`` layout of a run folder: ``utt_id, speaker,
language, ref, hyp, word_errors, ref_words, char_errors, ref_chars``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cluster_fl.data.vocab import normalize_text  # one normalisation for transcripts and WER
from cluster_fl.eval.metrics import error_counts, summarize
from cluster_fl.models.decoding import greedy_decode
from cluster_fl.models.speech_llm import SpeechLLM, collate
from cluster_fl.progress import progress

EVAL_COLUMNS = ("utt_id", "speaker", "language", "ref", "hyp", "word_errors", "ref_words",
                "char_errors", "ref_chars")


def _field(item: Any, *names: str) -> Any:
    for n in names:
        if isinstance(item, dict) and n in item:
            return item[n]
        if hasattr(item, n):
            return getattr(item, n)
    raise KeyError(f"evaluation item lacks {names[0]!r}")


AUTO_MARGIN = 0.25  # eval.max_new_tokens=auto: the longest reference's tokens plus a quarter,
AUTO_MIN_MARGIN = 8  # and at least 8 tokens (a hypothesis may be longer than its reference)


def decode_budget(setting: int | str, tokenizer: Any, transcripts: Sequence[str]) -> int:
    """``eval.max_new_tokens`` as a number: itself, or for ``auto`` the longest of
    ``transcripts`` in ``tokenizer``'s tokens plus a margin (``AUTO_MARGIN``, at least
    ``AUTO_MIN_MARGIN``). Sized from the whole evaluation set, so every lane and batch decodes
    to the same limit."""
    if setting != "auto":
        return int(setting)
    longest = max((len(tokenizer.encode(normalize_text(t))) for t in transcripts), default=0)
    return longest + max(AUTO_MIN_MARGIN, int(longest * AUTO_MARGIN + 0.999))


def transcribe(model: SpeechLLM, utterances: Sequence[Any], batch_size: int = 32,
               max_new_tokens: int = 64, ctc: bool = False, decode_cache: str = "auto",
               show: bool = True, cut: list[bool] | None = None) -> list[str]:
    """Greedy hypotheses for items with ``features`` / ``transcript`` / ``language``, in order.

    Items are batched by length (less padding); results come back in input order. ``ctc``:
    the encoder's CTC head transcribes instead of the decoder (an encoder-only yardstick).
    ``decode_cache``: the decoder's KV cache (``eval.decode_cache``; the same hypotheses).
    ``show``: a progress bar on a terminal, lines in a log when it takes long (``progress``).
    ``cut``, when given, gets one flag per item in input order: cut by ``max_new_tokens``.
    """
    order = sorted(range(len(utterances)),
                   key=lambda i: _field(utterances[i], "features").shape[-1])
    hyps: list[str] = [""] * len(utterances)
    flags = [False] * len(utterances)
    for start in progress(range(0, len(order), batch_size), desc="decoding", unit="batch",
                          enabled=show):
        chunk = order[start:start + batch_size]
        items = [utterances[i] for i in chunk]
        batch = collate([_field(u, "features").float() if torch.is_tensor(_field(u, "features"))
                         else _field(u, "features") for u in items],
                        [_field(u, "transcript", "text") for u in items],
                        [_field(u, "language") for u in items])
        chunk_cut: list[bool] = []
        out = (model.ctc_transcribe(batch) if ctc
               else greedy_decode(model, batch, max_new_tokens, cache=decode_cache,
                                  cut=chunk_cut))
        for i, h, c in zip(chunk, out, chunk_cut or [False] * len(chunk)):
            hyps[i], flags[i] = h, c
    if cut is not None:
        cut.extend(flags)
    return hyps


def evaluate(model: SpeechLLM, utterances: Sequence[Any], batch_size: int = 32,
             max_new_tokens: int = 64, bootstrap: int = 1000, seed: int = 0, ctc: bool = False,
             decode_cache: str = "auto") -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(summary, rows): pooled / per-language WER and CER with speaker-bootstrap CIs, and one
    row per utterance in the ``eval.parquet`` layout (``ctc``, ``decode_cache``: see
    :func:`transcribe`; ``max_new_tokens`` may be ``auto``: :func:`decode_budget`). The summary
    also counts the hypotheses cut by the limit (``hypotheses_cut``) and gives the limit."""
    budget = max_new_tokens if max_new_tokens != "auto" else decode_budget(
        "auto", model.tokenizer, [_field(u, "transcript", "text") for u in utterances])
    cut: list[bool] = []
    hyps = transcribe(model, utterances, batch_size, budget, ctc, decode_cache, cut=cut)
    rows = score_rows(utterances, hyps)
    return {**summarize(rows, bootstrap=bootstrap, seed=seed), "hypotheses_cut": sum(cut),
            "max_new_tokens": budget}, rows


def score_rows(utterances: Sequence[Any], hyps: Sequence[str]) -> list[dict[str, Any]]:
    """One ``eval.parquet`` row per utterance: normalised reference and hypothesis, error counts."""
    rows = []
    for u, hyp in zip(utterances, hyps):
        ref, hyp = normalize_text(_field(u, "transcript", "text")), normalize_text(hyp)
        rows.append({"utt_id": str(_field(u, "utterance_id", "utt_id")),
                     "speaker": str(_field(u, "speaker")),
                     "language": str(_field(u, "language")),
                     "ref": ref, "hyp": hyp, **error_counts(ref, hyp)})
    return rows

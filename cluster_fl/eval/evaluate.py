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


def transcribe(model: SpeechLLM, utterances: Sequence[Any], batch_size: int = 32,
               max_new_tokens: int = 64, ctc: bool = False, decode_cache: str = "auto",
               show: bool = True) -> list[str]:
    """Greedy hypotheses for items with ``features`` / ``transcript`` / ``language``, in order.

    Items are batched by length (less padding); results come back in input order. ``ctc``:
    the encoder's CTC head transcribes instead of the decoder (an encoder-only yardstick).
    ``decode_cache``: the decoder's KV cache (``eval.decode_cache``; the same hypotheses).
    ``show``: a progress bar on a terminal, lines in a log when it takes long (``progress``).
    """
    order = sorted(range(len(utterances)),
                   key=lambda i: _field(utterances[i], "features").shape[-1])
    hyps: list[str] = [""] * len(utterances)
    for start in progress(range(0, len(order), batch_size), desc="decoding", unit="batch",
                          enabled=show):
        chunk = order[start:start + batch_size]
        items = [utterances[i] for i in chunk]
        batch = collate([_field(u, "features").float() if torch.is_tensor(_field(u, "features"))
                         else _field(u, "features") for u in items],
                        [_field(u, "transcript", "text") for u in items],
                        [_field(u, "language") for u in items])
        out = (model.ctc_transcribe(batch) if ctc
               else greedy_decode(model, batch, max_new_tokens, cache=decode_cache))
        for i, h in zip(chunk, out):
            hyps[i] = h
    return hyps


def evaluate(model: SpeechLLM, utterances: Sequence[Any], batch_size: int = 32,
             max_new_tokens: int = 64, bootstrap: int = 1000, seed: int = 0, ctc: bool = False,
             decode_cache: str = "auto") -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(summary, rows): pooled / per-language WER and CER with speaker-bootstrap CIs, and one
    row per utterance in the ``eval.parquet`` layout (``ctc``, ``decode_cache``: see
    :func:`transcribe`)."""
    hyps = transcribe(model, utterances, batch_size, max_new_tokens, ctc, decode_cache)
    rows = score_rows(utterances, hyps)
    return summarize(rows, bootstrap=bootstrap, seed=seed), rows


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

"""Evaluation: WER/CER (jiwer) pooled and per language, speaker-clustered bootstrap CIs.

    evaluate(model, utterances, batch_size, max_new_tokens, bootstrap, seed) -> (summary, rows)
"""

from cluster_fl.eval.evaluate import (EVAL_COLUMNS, decode_budget, evaluate, score_rows,
                                      transcribe)
from cluster_fl.eval.metrics import bootstrap_ci, error_counts, summarize

__all__ = ["EVAL_COLUMNS", "bootstrap_ci", "decode_budget", "error_counts", "evaluate", "score_rows",
           "summarize", "transcribe"]

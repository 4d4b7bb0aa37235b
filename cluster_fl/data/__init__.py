"""Speech data: synthetic eSpeak corpus, MLS-layout reader, clients, cached log-mel features.

Public API (see each module): ``make_corpus`` (corpus.py); ``load_utterances``, ``find_shards``,
``partition_clients``, ``partition_report``, ``format_partition_report``, ``count_clients``
(mls.py); ``Example``, ``pad_examples``, ``log_mel`` (features.py); ``FeatureStore``,
``IndexedClient`` (store.py: the features store, per speaker);
``PackedExamples``, ``pack_examples`` (packed.py); ``normalize_text``, ``vocabulary``,
``LANGUAGES`` (vocab.py).

Names are imported lazily, so the corpus renderer's worker processes (and ``cluster-fl account``,
which only counts clients) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "make_corpus": "corpus",
    "load_utterances": "mls", "find_shards": "mls", "partition_clients": "mls",
    "partition_report": "mls", "format_partition_report": "mls", "count_clients": "mls",
    "Utterance": "mls", "Client": "mls", "CorpusWarning": "mls", "describe_corpus": "mls",
    "FeatureStore": "store", "IndexedClient": "store", "Example": "features", "pad_examples": "features",
    "log_mel": "features", "PackedExamples": "packed", "pack_examples": "packed",
    "normalize_text": "vocab", "vocabulary": "vocab", "LANGUAGES": "vocab",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cluster_fl.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"cluster_fl.data.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

"""Fixtures for model tests.

``utterances`` / ``batch``: real eSpeak audio (log-mel features of the shared ``tiny_corpus``).
``make_examples(n, seed)``: random features with closed-vocabulary transcripts and two speakers
per language, for tests that need more speakers than the tiny corpus has (held-out splits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

LANGS = ("en", "de", "fr", "pl")


@dataclass
class FakeExample:
    features: torch.Tensor
    transcript: str
    utterance_id: str
    speaker: str
    language: str


def random_examples(n: int = 8, seed: int = 0) -> list[FakeExample]:
    """Random 80-bin features whose length grows with the transcript."""
    from cluster_fl.data.vocab import WORDS

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lang = LANGS[i % len(LANGS)]
        words = [WORDS[lang][int(j)] for j in rng.integers(len(WORDS[lang]), size=2 + i % 3)]
        text = " ".join(words)
        frames = 20 + 6 * len(text)
        feats = torch.tensor(rng.standard_normal((80, frames)), dtype=torch.float32)
        out.append(FakeExample(feats, text, f"u{i}", f"{lang}-s{(i // len(LANGS)) % 2}", lang))
    return out


@pytest.fixture(scope="session")
def utterances(tiny_corpus) -> list:
    """Real eSpeak utterances (public split of the shared ``tiny_corpus``), a mix of languages."""
    from cluster_fl.data import FeatureStore

    torch.set_num_threads(1)
    examples = FeatureStore(tiny_corpus).split("public")
    by_lang: dict[str, list] = {}
    for e in examples:
        by_lang.setdefault(e.language, []).append(e)
    mixed = [e for group in zip(*by_lang.values()) for e in group]  # interleave languages
    return mixed[:8]


@pytest.fixture(scope="session")
def make_examples():
    """``make_examples(n, seed)``: random-feature examples (speaker ids ``<lang>-s0/1``)."""
    return random_examples


@pytest.fixture(scope="session")
def batch(utterances):
    from cluster_fl.models import collate

    return collate([u.features for u in utterances[:4]], [u.transcript for u in utterances[:4]],
                   [u.language for u in utterances[:4]])

"""Session-wide fixtures shared by several test folders.

``tiny_corpus``: a real eSpeak corpus in the MLS layout (en, de, fr; public 3 speakers x 8
utterances, private 3 x 6, test 1 x 6 per language; seed 0), rendered once per session in a
temporary folder (about a second on one core). Owned by the data helper; the integrator owns
this file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# model.compile: auto compiles the training step on AMX CPUs (and on GPUs); the suite's hundreds
# of short runs stay eager (inherited by every run it starts). The compiled step has its own
# tests, which ask for it explicitly (model.compile=true).
os.environ.setdefault("CLUSTER_FL_COMPILE", "0")

TINY_LANGUAGES = ("en", "de", "fr")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny synthetic corpus (see module docstring)."""
    from cluster_fl.data.corpus import make_corpus

    root = tmp_path_factory.mktemp("tiny_corpus")
    make_corpus(root, TINY_LANGUAGES, seed=0, public_speakers=3, private_speakers=3,
                test_speakers=1, public_utterances=8, private_utterances=(4, 8),
                test_utterances=6, workers=1, progress=False)
    return root

"""Fixtures of the reliability suite: the uninterrupted reference run every test is held against.

``reference`` is a real 3-round ``run_training`` in this process on the session's tiny corpus (it
also fills the corpus's feature cache, so the runs under test do not race to write it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_helpers import result, train_in_process  # noqa: E402


@pytest.fixture(scope="session")
def reference(tiny_corpus, tmp_path_factory) -> dict:
    folder = train_in_process(tiny_corpus, tmp_path_factory.mktemp("reliability_reference"))
    return {"folder": folder, **result(folder)}

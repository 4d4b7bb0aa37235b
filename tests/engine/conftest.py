"""Fixtures of the engine tests: one reference training run shared by the parity and resume tests.

``reference_run`` is a real 2-round ``run_training`` of the tiny model on the session's tiny corpus
in a fresh single process (``LocalComm``), read back from its run folder: final trainable state
(checkpoint), round rows without wall time, and the folder itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_helpers import tiny_overrides, training_worker  # noqa: E402


@pytest.fixture(scope="session")
def reference_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reference")


@pytest.fixture(scope="session")
def reference_run(tiny_corpus, reference_out) -> dict:
    """The uninterrupted single-process run (also fills the corpus's feature cache)."""
    from cluster_fl.distributed import spawn

    return spawn(training_worker, 1, tiny_overrides(tiny_corpus, reference_out), use_fake=True,
                 timeout_s=150)[0]

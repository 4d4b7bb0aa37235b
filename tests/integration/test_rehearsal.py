"""The cluster rehearsal on local processes (``grid --cluster local``):
pre-flight, training jobs at real widths (depth cut), ``status``, ``table``, through the CLI.
The same rehearsal runs on a real one-node SLURM in tests/slurm/test_slurm_rehearsal.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rehearsal import rehearse  # noqa: E402

pytestmark = pytest.mark.slow  # four real-width (one-layer) runs in fresh processes


def test_the_rehearsal_on_local_processes(tmp_path):
    rehearse(tmp_path, "local")

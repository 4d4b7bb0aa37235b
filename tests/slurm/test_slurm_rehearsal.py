"""The cluster rehearsal on the one-node SLURM that ``.ci/run`` starts
(launch/slurm-local-up.sh): pre-flight asks the real ``sinfo`` and ``sbatch --test-only``, the
four real-width (one-layer) runs are one array job, then ``status`` and ``table``
(tests/integration/rehearsal.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from rehearsal import rehearse  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def test_the_rehearsal_on_slurm(tmp_path):
    rehearse(tmp_path, "slurm")

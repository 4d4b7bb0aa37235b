"""Fixtures of the SLURM tests: they run against a real cluster (``launch/slurm-local-up.sh``,
started by ``.ci/run``) and skip when none answers. Marked ``slurm``; the default run leaves them
out (``pyproject.toml``), ``python -m pytest -q -m slurm tests/slurm`` runs them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_helpers import cluster_problem  # noqa: E402


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """Skip unless a SLURM controller, an idle-or-busy node and accounting (sacct) answer."""
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)

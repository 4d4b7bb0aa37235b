"""Fixtures of the SLURM tests: they run against a real cluster (``launch/slurm-local-up.sh``,
started by ``.ci/run``) and skip when none answers -- unless ``CFL_REQUIRE_SLURM=1`` (set by
``.ci/run`` once it has started the cluster), where a cluster with a problem FAILS the tests: a CI
that started SLURM and then ran none of its tests must not be green. Marked ``slurm``; the default
run leaves them out (``pyproject.toml``), ``python -m pytest -q -m slurm tests/slurm`` runs them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_helpers import cluster_problem  # noqa: E402


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """Skip unless a SLURM controller, an idle-or-busy node and accounting (sacct) answer; fail
    instead where the cluster is required (``CFL_REQUIRE_SLURM=1``)."""
    problem = cluster_problem()
    if problem and os.environ.get("CFL_REQUIRE_SLURM") == "1":
        pytest.fail(f"CFL_REQUIRE_SLURM=1 but the cluster has a problem: {problem}")
    if problem:
        pytest.skip(problem)

"""Fixtures of the privacy tests: one torch thread, a probe-norm file."""

from __future__ import annotations

import json

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def probe_file(tmp_path_factory):
    """Probe norms for every group name the tests use (``enc.i``, ``dec.i``, ``conn.*``, ``g.i``)."""
    names = ([f"enc.{i}" for i in range(8)] + [f"dec.{i}" for i in range(8)]
             + ["conn.w", "conn.b"] + [f"g.{i}" for i in range(8)])
    path = tmp_path_factory.mktemp("probe") / "probe.json"
    path.write_text(json.dumps({n: 0.01 * (1 + i) for i, n in enumerate(names)}))
    return str(path)



"""The CLI caps libgomp's spin before torch loads (``GOMP_SPINCOUNT``), and leaves a user's own
OpenMP wait settings alone; a process that already imported torch is too late to change it."""

from __future__ import annotations

import subprocess
import sys

from cluster_fl.cli import SPINCOUNT, bound_openmp_spin


def test_the_cap_is_set_only_where_the_user_set_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    env: dict[str, str] = {}
    assert bound_openmp_spin(env) and env == {"GOMP_SPINCOUNT": SPINCOUNT}
    for own in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(own)
        assert not bound_openmp_spin(env) and env == own


def test_a_command_sees_the_cap_before_torch_loads():
    code = ("import os, sys; from cluster_fl import cli; "
            "assert 'torch' not in sys.modules; cli.bound_openmp_spin(os.environ); "
            "import torch; print(os.environ['GOMP_SPINCOUNT'])")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == SPINCOUNT

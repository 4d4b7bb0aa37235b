"""What ``model.dtype: auto`` and ``model.compile: auto`` resolve to (cluster_fl.precision)."""

from __future__ import annotations

import pytest
import torch

from cluster_fl import precision


@pytest.mark.parametrize("fast", [True, False])
def test_auto_is_bf16_on_cpu_only_for_a_compiled_step_on_a_fast_bf16_cpu(monkeypatch, fast):
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: fast)
    assert precision.resolve_dtype("auto", "cpu", compiled=True) == (
        torch.bfloat16 if fast else torch.float32)
    assert precision.resolve_dtype("auto", "cpu", compiled=False) == torch.float32
    assert precision.resolve_dtype("float16", "cpu", compiled=False) == torch.float16
    monkeypatch.delenv("CLUSTER_FL_COMPILE", raising=False)
    assert precision.resolve_compile("auto", "cpu") is fast
    assert precision.resolve_compile("auto", "cuda") is True
    assert precision.resolve_compile(False, "cuda") is False
    assert precision.resolve_compile(True, "cpu") is True


def test_the_environment_decides_auto_compilation_only(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setenv("CLUSTER_FL_COMPILE", "0")
    assert precision.resolve_compile("auto", "cuda") is False
    assert precision.resolve_compile(True, "cpu") is True  # an explicit value wins
    monkeypatch.setenv("CLUSTER_FL_COMPILE", "1")
    assert precision.resolve_compile("auto", "cpu") is True
    assert precision.dtype_name("auto", "cpu", compiled=True) == "bfloat16"


def test_this_machines_probe_answers():
    assert isinstance(precision.cpu_has_fast_bf16(), bool)


def test_auto_compiles_on_a_cpu_without_fast_bf16_when_the_run_repays_it(monkeypatch):
    """Without fast bf16 the step is fp32 either way; compiling pays once a lane's steps over the
    run amortise the compile (``COMPILE_PAYS_AFTER_STEPS``, measured by bench/step_profile.py)."""
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.delenv("CLUSTER_FL_COMPILE", raising=False)
    n = precision.COMPILE_PAYS_AFTER_STEPS
    assert n > 0
    assert precision.resolve_compile("auto", "cpu") is False  # length unknown: eager
    assert precision.resolve_compile("auto", "cpu", n - 1) is False
    assert precision.resolve_compile("auto", "cpu", n) is True
    assert precision.resolve_compile(False, "cpu", 10 * n) is False  # an explicit value wins
    assert precision.run_precision("auto", "auto", "cpu", n) == (torch.float32, True)
    monkeypatch.setenv("CLUSTER_FL_COMPILE", "0")
    assert precision.resolve_compile("auto", "cpu", 10 * n) is False

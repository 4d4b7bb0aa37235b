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

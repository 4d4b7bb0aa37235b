"""provenance.json (cluster_fl/engine/provenance.py): the starting model's SHA-256 is fixed by a
run's first attempt and a resume from other bytes is refused; every attempt records the CPU's
kernel-relevant features (the study's starting model differs between an AMX and a non-AMX core)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from cluster_fl.config import override
from cluster_fl.engine.provenance import FILE, cpu, record_attempt
from cluster_fl.errors import UserError
from engine_helpers import engine_config


def _checkpoint(folder, data: bytes):
    folder.mkdir(exist_ok=True)
    (folder / "model.pt").write_bytes(data)
    return str(folder)


def test_the_first_attempt_fixes_the_starting_model_and_a_changed_one_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = override(engine_config(), {"model.checkpoint": _checkpoint(tmp_path / "ck", b"v1" * 999)})
    record_attempt(run, cfg)
    record = record_attempt(run, cfg)  # a resume on the same bytes: appended
    assert record["starting_model"]["model_sha256"] == hashlib.sha256(b"v1" * 999).hexdigest()
    assert len(json.loads((run / FILE).read_text())["attempts"]) == 2

    _checkpoint(tmp_path / "ck", b"v2" * 999)  # rebuilt elsewhere: other bytes, same path
    with pytest.raises(UserError, match="starting model changed since the run began"):
        record_attempt(run, cfg)
    assert len(json.loads((run / FILE).read_text())["attempts"]) == 2  # nothing appended


def test_an_attempt_names_the_cpu_and_its_kernel_features(tmp_path, monkeypatch):
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(var, raising=False)  # a user's own cap is not this test's subject
    info = cpu()
    assert info["model"] and isinstance(info["features"], list)
    flags: set[str] = set()
    if Path("/proc/cpuinfo").exists():
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith(("flags", "Features")))
        flags = set(line.partition(":")[2].split())
    for feature in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"):
        assert (feature in info["features"]) == (feature in flags)
    assert info["dispatch"] == torch.backends.cpu.get_cpu_capability() and "caps" not in info
    record = record_attempt(tmp_path, engine_config())
    attempt = record["attempts"][0]
    assert attempt["cpu"] == info and attempt["torch"] and attempt["host"]


def test_an_attempt_records_an_instruction_set_cap(tmp_path, monkeypatch):
    """A core run with its kernels capped (results/LOG.md, 2026-12-06: the AVX2 stand-in for
    another machine) computes other floats; its folder says so."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    attempt = record_attempt(tmp_path, engine_config())["attempts"][0]
    assert attempt["cpu"]["caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

"""Two ranks on one GPU (``-m gpu``, skipped without CUDA): two gloo ranks
(NCCL refuses two ranks on one device) share the one GPU -- each finds it at ``cuda:0`` from its
LOCAL_RANK and the visible device count (``distributed.launch.device_index``) -- train 2 rounds of the
tiny model, and make the clip decision of the 1-process run on the same GPU for every client of
both rounds, and its evaluation rows. Run by ``bench/gpu_check.sh``. Multi-GPU NCCL between
ranks cannot be tested on one GPU and is not simulated here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_helpers import decisions_worker, tiny_overrides  # noqa: E402

from cluster_fl.distributed import spawn  # noqa: E402

# clipped and unclipped clients both (C just above the tiny model's typical first-round norm)
# (eager: this test is about ranks; the compiled step is measured by bench/gpu_check.sh)
MIXED = ["run.device=cuda", "privacy.clipping=flat", "privacy.clip_norm=0.41",
         "model.compile=false"]


def deterministic_worker(comm, overrides):
    """:func:`decisions_worker` with CUDA's deterministic kernels (atomics in some backward
    kernels would otherwise make the two runs differ by rounding, not by the ranks)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = decisions_worker(comm, overrides)
    out["device"] = str(torch.cuda.current_device())
    return out


def test_two_ranks_on_one_gpu_make_the_one_process_runs_clip_decisions_and_rows(tiny_corpus,
                                                                                tmp_path):
    import pyarrow.parquet as pq

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # inherited by the ranks
    one = spawn(deterministic_worker, 1, tiny_overrides(tiny_corpus, tmp_path / "one", *MIXED),
                use_fake=True, timeout_s=400)
    two = spawn(deterministic_worker, 2, tiny_overrides(tiny_corpus, tmp_path / "two", *MIXED),
                timeout_s=400)
    assert [r["device"] for r in two] == ["0", "0"]  # LOCAL_RANK 1 found the one GPU too
    a = one[0]["decisions"]
    b = {k: v for r in two for k, v in r["decisions"].items()}
    assert a.keys() == b.keys() and len(a) >= 8
    assert {k: v[:2] for k, v in a.items()} == {k: v[:2] for k, v in b.items()}
    flags = [v[0] for v in a.values()]
    assert any(flags) and not all(flags), "the test needs clipped and unclipped clients"
    rows_one = pq.read_table(Path(one[0]["folder"]) / "eval.parquet").to_pylist()
    rows_two = pq.read_table(Path(two[0]["folder"]) / "eval.parquet").to_pylist()
    assert len(rows_one) == 4 and rows_one == rows_two
    assert [r["clip_rate"] for r in one[0]["rows"]] == [r["clip_rate"] for r in two[0]["rows"]]
    assert "cuda" in (Path(two[0]["folder"]) / "log.txt").read_text()

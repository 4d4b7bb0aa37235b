"""The cluster path on a real GPU (``-m gpu``; skipped without CUDA): the tiny model trains 2
rounds on CUDA with a bf16 base under NCCL (1 rank, through torchrun) and makes the same clip
decisions as the same run on CPU (bf16 autocast there too). Run by ``bench/gpu_check.sh``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RUN = ["model.arch=whisper-tinyllama-tiny", "model.dtype=bfloat16", "fl.rounds=2",
       "fl.clients_per_round=4", "fl.sampling=fixed", "fl.max_local_steps=2", "fl.batch_size=4",
       "eval.max_utterances=4", "eval.bootstrap=10", "eval.max_new_tokens=6",
       "privacy.diagnostics=exact", "privacy.clipping=alpha-split", "run.threads=1",
       "model.compile=false"]  # eager: the compiled step is measured by bench/gpu_check.sh


def _train(tiny_corpus: Path, out: Path, device: str, torchrun: bool) -> Path:
    overrides = [f"data.corpus={tiny_corpus}", "data.languages=[en,de,fr]", f"run.out={out}",
                 f"run.device={device}", *RUN]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
                if torchrun else [sys.executable])
    demo = Path(__file__).resolve().parents[2] / "cluster_fl" / "assets" / "demo.yaml"
    proc = subprocess.run([*launcher, "-m", "cluster_fl", "train", str(demo), *overrides],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def test_tiny_model_on_cuda_in_bf16_makes_the_cpu_runs_clip_decisions(tiny_corpus, tmp_path):
    from cluster_fl.engine.checkpoint import load_run_checkpoint
    from cluster_fl.engine.metrics import read_rows

    gpu = _train(tiny_corpus, tmp_path / "gpu", "cuda", torchrun=True)
    cpu = _train(tiny_corpus, tmp_path / "cpu", "cpu", torchrun=False)
    rows_gpu, rows_cpu = read_rows(gpu / "rounds.parquet"), read_rows(cpu / "rounds.parquet")
    assert [r["round"] for r in rows_gpu] == [1, 2]
    from cluster_fl.engine.operator_log import read_operator_log

    def cohorts(folder):
        return [e["cohort"] for e in read_operator_log(folder) if e["event"] == "round"]

    assert cohorts(gpu) == cohorts(cpu)
    for a, b in zip(rows_gpu, rows_cpu):
        for key in [k for k in a if k.startswith("clip_rate")]:
            assert a[key] == b[key], (a["round"], key)
    state = load_run_checkpoint(gpu)["state"]
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in state.values())
    assert "cuda" in (gpu / "log.txt").read_text()


def test_batched_clients_on_cuda_equal_one_client_at_a_time(tiny_corpus, tmp_path, monkeypatch):
    # many clients per step on the GPU: a block of 3 clients (one with fewer batches) in one batched step per
    # local step gives each client its one-client update (fp32 base: the float tolerance of
    # tests/engine/test_batched.py; bf16 would compare rounding, not batching). cuDNN runs fp32
    # convolutions (the encoder's front end) in TF32 by default, with algorithms that depend on
    # the batch shape: measured on an H200, 3.4e-4 relative with TF32, < 1e-4 without it (fp32
    # matmuls are already full precision by default).
    from cluster_fl.config import load_config
    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine import setup

    cfg = load_config(None, [f"data.corpus={tiny_corpus}", "data.languages=[en,de,fr]",
                             f"run.out={tmp_path}", "run.device=cuda", *RUN,
                             "model.dtype=float32", "fl.clients_per_step=3", "fl.batch_size=2",
                             "fl.max_local_steps=3", "fl.rows_per_pass=0"])
    world = setup.build_world(cfg, LocalComm(), lambda m: None)
    # parallelize turns TF32 on for CUDA (a default for speed); this comparison is about batching
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=g).to(v.device)
             for k, v in world.initial_state.items()}
    block = [(c.index, c.load()) for c in world.engine.clients[:3]]
    block[1] = (block[1][0], block[1][1][:3])
    runner = world.engine.runner
    seq = [runner.train(i, items, state, 1) for i, items in block]
    bat = list(runner.train_cohort(block, state, 1))
    for a, b in zip(seq, bat):
        assert a.steps == b.steps
        assert all(v.device.type == "cuda" for v in b.delta.values())
        num = sum(float((a.delta[k] - b.delta[k]).double().norm() ** 2) for k in a.delta)
        den = sum(float(a.delta[k].double().norm() ** 2) for k in a.delta)
        assert (num / den) ** 0.5 < 1e-4, a.client

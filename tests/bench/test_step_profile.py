"""The step profiler (bench/step_profile.py) on a run's own config, at a tiny size.

What must hold: the hooks it wraps still exist (a renamed engine method broke ``profile`` once,
unnoticed), it counts the client updates and local steps the rounds really trained (Poisson
cohorts vary, so the benchmark's nominal cohort would be wrong), and -- slow, it compiles -- the
round it profiles runs the compiled layers: under FlopCounterMode dynamo drops them and they
stay eager afterwards, so a profile taken after the FLOP count described eager code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import step_profile  # noqa: E402

from cluster_fl.config import dump_config, load_config  # noqa: E402

STEPS, BATCH = 2, 2


def _config_file(corpus: Path, tmp: Path, *extra: str) -> Path:
    cfg = load_config(None, [f"data.corpus={corpus}", "data.languages=[en,de,fr]",
                             f"run.out={tmp}", "model.arch=whisper-tinyllama-tiny",
                             "fl.sampling=fixed", "fl.clients_per_round=3",
                             f"fl.max_local_steps={STEPS}", f"fl.batch_size={BATCH}",
                             "privacy.noise_multiplier=0.5", *extra])
    path = tmp / "config.yaml"
    path.write_text(dump_config(cfg))
    return path


@pytest.mark.slow  # ~8 s; .ci/run's bench stage runs tests/bench with its slow tests
def test_profile_counts_the_updates_and_steps_a_run_config_trains(tiny_corpus, tmp_path):
    p = step_profile.profile(["model.compile=false"], rounds=1,
                             config_file=_config_file(tiny_corpus, tmp_path), top_ops=5)
    assert p["compiled"] is False
    assert p["steps_per_update"] == pytest.approx(STEPS)
    # the timed round trained 3 clients: the per-update split adds up to the wall time
    parts = p["per_update_s"]
    assert parts["wall"] > 0 and parts["compute"] > 0
    assert sum(v for k, v in parts.items() if k != "wall") == pytest.approx(parts["wall"],
                                                                            rel=1e-6)
    assert p["flops_per_step"] > 0 and p["achieved_gflops"] > 0
    assert len(p["top_ops"]) == 5 and all(o["calls"] > 0 for o in p["top_ops"])
    assert "aten::mm" in {o["op"] for o in p["top_ops"]}
    kinds = p["matrix_by_kind"]
    lora = kinds["low-rank products (a dim <= 16: LoRA)"]
    assert lora["calls"] > 0 and lora["gflops"] > 0
    assert kinds["dense products (projections, MLP)"]["calls"] > 0
    # a step's parts by wall time: every part timed, together the step's own time
    step = p["step_parts_s"]
    assert all(v > 0 for v in step.values()), step
    assert sum(step.values()) == pytest.approx(p["step_s"], rel=1e-6)


def test_matrix_by_kind_splits_lora_projections_attention_and_convolutions():
    us = 1e-6
    events = [("aten::mm", [[800, 4], [4, 192], [800, 192]], 50 * us),  # LoRA B (out= buffer)
              ("aten::mm", [[192, 800], [800, 4]], 50 * us),        # LoRA B's gradient
              ("aten::addmm", [[192], [800, 128], [128, 192], [], []], 100 * us),
              ("aten::mm", [[800, 192], [192, 192]], 100 * us),
              ("aten::bmm", [[32, 100, 48], [32, 48, 100]], 200 * us),
              ("aten::baddbmm", [[4, 1, 192], [4, 200, 4], [4, 4, 192]], 10 * us),  # stacked
              ("aten::mkldnn_convolution", [[8, 80, 300], [128, 80, 3]], 300 * us),
              ("aten::mul", [[800, 192], [800, 192]], 999 * us)]    # not matrix work
    kinds = step_profile.matrix_by_kind(events)
    lora = kinds["low-rank products (a dim <= 16: LoRA)"]
    assert lora["calls"] == 3
    assert lora["flops"] == 2 * (2 * 800 * 4 * 192) + 2 * 4 * 200 * 4 * 192
    dense = kinds["dense products (projections, MLP)"]
    assert dense["calls"] == 2
    assert dense["flops"] == 2 * 800 * 128 * 192 + 2 * 800 * 192 * 192
    assert dense["gflops"] == pytest.approx(dense["flops"] / 200e-6 / 1e9)
    assert kinds["batched products (attention)"]["flops"] == 2 * 32 * 100 * 48 * 100
    assert kinds["convolutions"] == {"calls": 1, "s": pytest.approx(300e-6), "flops": 0.0,
                                     "gflops": 0.0}
    assert sum(k["calls"] for k in kinds.values()) == 7


def test_profile_refuses_a_config_with_compare(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "compare", "--config",
                                      str(tmp_path / "c.yaml")])
    with pytest.raises(SystemExit):
        step_profile.main()
    assert "--config goes with profile" in capsys.readouterr().err


@pytest.mark.slow
def test_the_profiled_round_runs_the_compiled_layers(tiny_corpus, tmp_path):
    p = step_profile.profile(["model.compile=true"], rounds=1,
                             config_file=_config_file(tiny_corpus, tmp_path), top_ops=200)
    assert p["compiled"] is True
    assert p["compute_split"]["compiled kernels"] > 0
    ops = {o["op"] for o in p["top_ops"]}
    assert any(op.startswith("Torch-Compiled Region") for op in ops), sorted(ops)[:20]

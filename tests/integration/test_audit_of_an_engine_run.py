"""A real engine run recorded with ``audit.record_channels=true``, then ``cluster-fl audit`` on it.

The audit's other tests read synthetic run folders; this one ties the audit to what the engine
really writes:

- ``cluster-fl audit RUN_DIR`` exits 0 and reports every declared channel as recorded, with the
  canary cell measured from the run's own uploads and releases;
- the noise the audit measures (n·release − Σ w_i·clipped_i, with ``aggregation.weighting:
  samples``) is, coordinate for coordinate, the noise the engine drew (regenerated from the
  research-mode seed): the recording, the weights and the denominator agree; with the weights
  ignored it is not (the research noise regenerated from the seed and the run's id, its scope);
- the released record holds no exact count and no timing (the side_stats cells that scan it);
- the report's encoder σ is the α-split encoder pool's σ/√α;
- a synthetic run folder (audit/synthetic.py) has the engine's files, keys and dtypes.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster_fl.audit.battery import Settings, measured_noise
from cluster_fl.audit.channels import BATTERY, load_recording
from cluster_fl.cli import main
from cluster_fl.config import load_config, override
from cluster_fl.engine.train import run_training
from cluster_fl.privacy import ResearchNoise

TINY = ["model.arch=whisper-tinyllama-tiny", "fl.clients_per_round=4", "fl.max_local_steps=2",
        "fl.batch_size=4", "eval.max_utterances=4", "eval.bootstrap=10", "eval.max_new_tokens=6",
        "run.threads=1"]
RECORDED = ["fl.rounds=2", "fl.sampling=fixed", "audit.record_channels=true",
            "aggregation.weighting=samples", "aggregation.weight_cap=6",
            "privacy.noise_multiplier=0.5", "audit.canaries=16"]


@pytest.fixture(scope="module")
def recorded(tiny_corpus, tmp_path_factory):
    torch.set_num_threads(1)
    cfg = load_config(None, [f"data.corpus={tiny_corpus}", "data.languages=[en,de,fr]",
                             f"run.out={tmp_path_factory.mktemp('recorded')}", *TINY, *RECORDED])
    return run_training(cfg), cfg


def test_cluster_fl_audit_reads_the_engines_recording(recorded, tmp_path, capsys):
    run, cfg = recorded
    assert main(["audit", str(run), "--out", str(tmp_path)]) == 0
    assert "report" in capsys.readouterr().out
    rep = json.loads((tmp_path / "report.json").read_text())
    assert {c["channel"]: c["recorded"] for c in rep["channels"]} == {
        "uploads": True, "partial_sums": True, "release": True, "side_stats": True}
    cells = {(c["channel"], a["attack"]) for c in rep["channels"] for a in c["attacks"]}
    assert cells == {(c, a) for c, a, _ in BATTERY}
    release = next(c for c in rep["channels"] if c["channel"] == "release")
    canary = next(a for a in release["attacks"] if a["attack"] == "canary_epsilon")
    assert canary["status"] == "measured", canary
    assert canary["canary"]["noise_source"].startswith("measured")
    side = next(c for c in rep["channels"] if c["channel"] == "side_stats")
    for attack in ("exact_counts", "timing"):  # the channels the privacy hardening removed, measured: gone
        cell = next(a for a in side["attacks"] if a["attack"] == attack)
        assert cell["status"] == "measured" and cell["verdict"] == "pass", cell
        assert cell["positive_control"]["fired"] and not cell["negative_control"]["fired"]
    assert rep["privacy"]["encoder_pool"] == "encoder"
    assert rep["privacy"]["encoder_sigma"] == pytest.approx(0.5 / math.sqrt(cfg.privacy.alpha))


def test_the_noise_the_audit_measures_is_the_noise_the_engine_drew(recorded):
    run, cfg = recorded
    rec = load_recording(run)
    assert len(set(rec.uploads["n_samples"].tolist())) > 1  # the weights really differ
    assert (rec.uploads["n_samples"] < cfg.aggregation.weight_cap).any()
    measured, source = measured_noise(rec, Settings(cfg))
    assert source.startswith("measured")
    noise = ResearchNoise(cfg.run.seed)
    std = cfg.privacy.noise_multiplier * cfg.privacy.clip_norm
    drawn = np.stack([np.concatenate([
        noise.gaussian(tuple(rec.releases["noised_mean"][g].shape[1:]), std, round=int(r),
                       stream=f"{run.name}/{g}", dtype=torch.float64).numpy().ravel()
        for g in rec.releases["noised_mean"]]) for r in rec.releases["rounds"]])
    assert measured.shape == drawn.shape and measured.shape[0] == 2
    error = np.abs(measured - drawn).max()
    print(f"largest difference {error:.3g}")
    assert error < 1e-6  # float32 rounding of the recorded mean and uploads
    unweighted, _ = measured_noise(rec, Settings(override(cfg, {"aggregation.weighting": "uniform"})))
    assert np.abs(unweighted - drawn).max() > 100 * error


def _kind(name: str) -> str:
    return re.sub(r"\d+", "N", name)


def _layout(obj):
    if isinstance(obj, dict):
        return {k: _layout(v) for k, v in obj.items() if k not in ("clipped", "raw_norms", "plain",
                                                                  "noised_mean")} | {
            k: sorted({str(t.dtype) for t in v.values()}) for k, v in obj.items()
            if k in ("clipped", "raw_norms", "plain", "noised_mean")}
    if isinstance(obj, torch.Tensor):
        return str(obj.dtype)
    return type(obj).__name__


def test_a_synthetic_run_folder_has_the_engines_files_keys_and_dtypes(recorded, tmp_path):
    from cluster_fl.audit.synthetic import write_synthetic_run

    run, _ = recorded
    fake = write_synthetic_run(tmp_path / "synthetic", n_speakers=4, rounds=1, ranks=1,
                               canaries=4)
    for name in ("config.yaml", "status.json", "groups.json", "privacy.json"):
        assert (fake / name).is_file() and (run / name).is_file(), name
    for name in ("status.json", "privacy.json"):
        assert set(json.loads((fake / name).read_text())) == \
            set(json.loads((run / name).read_text())), name
    assert set(json.loads((fake / "groups.json").read_text())[0]) == \
        set(json.loads((run / "groups.json").read_text())[0])
    engine_files = {_kind(p.name): p for p in sorted((run / "channels").iterdir())}
    fake_files = {_kind(p.name): p for p in sorted((fake / "channels").iterdir())}
    assert set(fake_files) == set(engine_files) == {"uploads_rN_rankN.pt", "partial_rN_rankN.pt",
                                                    "release_rN.pt"}
    for kind, path in engine_files.items():
        ours = torch.load(path, weights_only=False)
        theirs = torch.load(fake_files[kind], weights_only=False)
        assert _layout(theirs) == _layout(ours), kind


def test_the_synthetic_release_is_the_mean_of_the_recorded_uploads_plus_noise(tmp_path):
    from cluster_fl.audit.synthetic import write_synthetic_run

    run = write_synthetic_run(tmp_path / "s", n_speakers=6, rounds=2, ranks=2, sigma=1e-6,
                              canaries=4)
    rec = load_recording(run)
    noise, _ = measured_noise(rec, Settings(load_config(Path(run) / "config.yaml")))
    assert np.abs(noise).max() < 1e-4  # σC = 1e-6: the release is the recorded uploads' mean

"""The audit's clip path for every clipping method: the recorded (clipped) uploads and raw norms
rebuild the raw updates exactly, re-clipping them with the real policy gives the recording back,
the α sweep runs on a run recorded under that method, and the report's encoder σ is the encoder
pool's effective σ under that method (σ/√α only for α-split)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cluster_fl.audit.battery import encoder_pool_sigma
from cluster_fl.audit.channels import load_recording
from cluster_fl.audit.sweep import ALPHAS, alpha_sweep, clip_uploads, raw_updates
from cluster_fl.audit.synthetic import synthetic_groups, write_synthetic_run
from cluster_fl.config import CLIPPING_METHODS, INSIDE_POOL_RULES, build_config, load_config
from cluster_fl.privacy.clipping import make_policy

torch.set_num_threads(1)
POOLS = [{"name": "enc", "components": ["encoder"], "share": 0.2},
         {"name": "rest", "components": ["connector", "decoder"], "share": 0.8}]


def _settings(method: str, inside: str, tmp_path) -> dict:
    extra: dict = {"inside_pool": inside}
    if method == "pools":
        extra["pools"] = POOLS
    if method == "probe":
        path = tmp_path / "probe.json"
        path.write_text(json.dumps({g.name: 0.05 * (i + 1) for i, g in enumerate(synthetic_groups())}))
        extra["probe_norms"] = str(path)
    return extra


CASES = [(m, "size") for m in CLIPPING_METHODS if m not in ("alpha-split", "pools")] + \
        [(m, rule) for m in ("alpha-split", "pools") for rule in INSIDE_POOL_RULES]


@pytest.mark.parametrize("method, inside", CASES)
def test_recorded_uploads_rebuild_the_raw_update_and_reclip_to_the_recording(method, inside,
                                                                            tmp_path):
    groups = synthetic_groups()
    cfg = build_config({"privacy": {"clipping": method, "clip_norm": 1.0,
                                    **_settings(method, inside, tmp_path)}})
    policy = make_policy(cfg.privacy, groups)
    rng = np.random.default_rng(0)
    raws = [{g.name: torch.tensor(rng.standard_normal(g.shape) * scale, dtype=torch.float32)
             for g in groups} for scale in (1e-3, 0.05, 0.3, 2.0, 50.0)]
    raws.append({g.name: torch.full(g.shape, math.nan) for g in groups})  # a non-finite client
    results = [policy.clip(r) for r in raws]
    assert any(r.clipped for r in results[:-1]) and not all(r.clipped for r in results[:-1])
    recorded = {"clipped": {g.name: np.stack([r.update[g.name].numpy() for r in results])
                            for g in groups},
                "raw_norms": {g.name: np.array([r.group_norms[g.name] for r in results])
                              for g in groups}}
    rebuilt, exact = raw_updates(recorded)
    assert exact
    for g in groups:
        np.testing.assert_allclose(rebuilt[g.name][:-1], np.stack([r[g.name].numpy() for r in raws[:-1]]),
                                   rtol=2e-6, atol=1e-12)
        assert not rebuilt[g.name][-1].any()  # the non-finite client contributed zero
    again = clip_uploads(rebuilt, policy)
    for g in groups:
        np.testing.assert_allclose(again[g.name], recorded["clipped"][g.name], rtol=1e-5,
                                   atol=1e-9)


@pytest.mark.parametrize("method", CLIPPING_METHODS)
def test_the_alpha_sweep_and_the_encoder_sigma_under_every_method(method, tmp_path):
    inside = "size"
    run = write_synthetic_run(tmp_path / "run", n_speakers=8, languages=2, rounds=6, ranks=2,
                              sigma=0.5, canaries=8, clipping=method,
                              privacy=_settings(method, inside, tmp_path))
    rec = load_recording(run)
    cfg = load_config(run / "config.yaml")
    from cluster_fl.audit.battery import Settings

    rows = alpha_sweep(rec, Settings(cfg, seed=0))
    assert [r["alpha"] for r in rows] == list(ALPHAS)
    assert all(r["raw_rebuilt_exactly"] for r in rows)
    assert rows[0]["effective_sigma"] == pytest.approx(0.5 / math.sqrt(ALPHAS[0]))
    pool, sigma = encoder_pool_sigma(cfg, rec.groups)
    expected = {"alpha-split": ("encoder", 0.5 / math.sqrt(0.05)),
                "pools": ("enc", 0.5 / math.sqrt(0.2))}.get(method, ("all", 0.5))
    assert pool == expected[0] and sigma == pytest.approx(expected[1])

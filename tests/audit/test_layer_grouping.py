"""The audit under ``privacy.grouping: layer``: recorded uploads still rebuild the raw update
(every group of a unit is scaled by one factor), and the release canary is built with radii whose
joint norm is C although every group reports its unit's threshold."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cluster_fl.audit.battery import canary_thresholds, run_battery
from cluster_fl.audit.channels import load_recording
from cluster_fl.audit.sweep import clip_uploads, raw_updates
from cluster_fl.audit.synthetic import synthetic_groups, write_synthetic_run
from cluster_fl.config import build_config
from cluster_fl.privacy.clipping import make_policy

torch.set_num_threads(1)


@pytest.mark.parametrize("method", ["size", "uniform-ema", "quantile", "alpha-split"])
def test_layer_units_rebuild_the_raw_update_and_reclip_to_the_recording(method):
    groups = synthetic_groups()
    cfg = build_config({"privacy": {"clipping": method, "clip_norm": 1.0, "grouping": "layer"}})
    policy = make_policy(cfg.privacy, groups)
    assert len(policy.units) < len(groups)  # the synthetic model's groups do share units
    rng = np.random.default_rng(0)
    raws = [{g.name: torch.tensor(rng.standard_normal(g.shape) * scale, dtype=torch.float32)
             for g in groups} for scale in (1e-3, 0.05, 0.3, 2.0, 50.0)]
    results = [policy.clip(r) for r in raws]
    assert any(r.clipped for r in results) and not all(r.clipped for r in results)
    recorded = {"clipped": {g.name: np.stack([r.update[g.name].numpy() for r in results])
                            for g in groups},
                "raw_norms": {g.name: np.array([r.group_norms[g.name] for r in results])
                              for g in groups}}
    rebuilt, exact = raw_updates(recorded)
    assert exact
    for g in groups:
        np.testing.assert_allclose(rebuilt[g.name], np.stack([r[g.name].numpy() for r in raws]),
                                   rtol=2e-6, atol=1e-12)
    again = clip_uploads(rebuilt, policy)
    for g in groups:
        np.testing.assert_allclose(again[g.name], recorded["clipped"][g.name], rtol=1e-5,
                                   atol=1e-9)


def test_the_canary_of_a_layer_grouped_run_has_norm_c_and_passes(tmp_path, monkeypatch):
    from cluster_fl.audit import battery

    run = write_synthetic_run(tmp_path / "run", n_speakers=8, languages=4, rounds=20, ranks=2,
                              sigma=1.0, clipping="size", canaries=4000,
                              privacy={"grouping": "layer"})
    rec = load_recording(run)
    assert any(g["unit"] != g["name"] for g in rec.groups)
    radii = canary_thresholds(rec.groups)
    assert math.sqrt(math.fsum(r * r for r in radii.values())) == pytest.approx(1.0, rel=1e-12)
    used, real = [], battery.run_canaries

    def spy(noise, **kw):
        used.append(kw["thresholds"])
        return real(noise, **kw)

    monkeypatch.setattr(battery, "run_canaries", spy)
    rep = run_battery(run)
    assert used and all(math.sqrt(math.fsum(r * r for r in t)) == pytest.approx(1.0, rel=1e-12)
                        for t in used)  # the canary the battery built: the worst case C
    release = next(c for c in rep["channels"] if c["channel"] == "release")
    canary = next(a for a in release["attacks"] if a["attack"] == "canary_epsilon")["canary"]
    assert canary["bound"]["epsilon_lb"] <= canary["accounted_epsilon"]
    assert canary["verdict"] == "pass"

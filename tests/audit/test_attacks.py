"""Attacks and their controls on synthetic updates whose encoder part carries a speaker direction.

False-alarm rates (probability that a test fails although the code is right, at a random seed;
the seeds here are fixed, so each run is deterministic):
* positive control fires: the planted speaker signal is ~10 noise standard deviations per class
  direction -- failure probability negligible (< 1e-9);
* shuffled twin passes the gate: n = 6000, 50 speakers, baseline 0.02, se ≈ 0.18 pp; pass needs
  the CP upper bound (level 0.05/8, z ≈ 2.50) below +1 pp, i.e. a chance excess under ≈ +0.55 pp
  = 3.0 se: false alarm ≈ 1.3e-3;
* masked partial sums stay at chance: the "fired" test is the level-0.00625 lower bound, so
  false alarm ≤ 0.00625; the unmasked control is deterministic at this signal strength;
* zero-support checks and clip equivalence are deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster_fl.audit import attacks
from cluster_fl.audit.channels import battery_size, load_recording, partial_labels
from cluster_fl.audit.stats import gate
from cluster_fl.audit.synthetic import write_synthetic_run

torch.set_num_threads(1)
GATE = dict(m=battery_size(), family_alpha=0.05, margin_pp=1.0)


def _uploads(n_speakers: int = 50, rounds: int = 120, noise_std: float = 0.0, seed: int = 0):
    """Encoder 'uploads': per-round noise + a fixed speaker direction, plus the DP view's noise."""
    rng = np.random.default_rng(seed)
    d = 64
    dirs = rng.standard_normal((n_speakers, d))
    spk = np.tile(np.arange(n_speakers), rounds)
    rnd = np.repeat(np.arange(rounds), n_speakers)
    x = 0.3 * rng.standard_normal((len(spk), d)) + dirs[spk]
    x *= 0.1 / np.linalg.norm(x, axis=1, keepdims=True)  # clipped to the encoder threshold
    x += noise_std * rng.standard_normal(x.shape)
    return x, spk.astype(str), rnd


def _score(x, labels, rounds):
    grouping, groups = attacks.speaker_grouping(labels, labels, rounds)
    assert grouping == "round"  # clients = speakers: identity must be learnt across rounds
    out = attacks.probe(x, labels, groups, grouping)
    return gate(out.correct, out.n, out.baseline, **GATE)


def test_speaker_probe_fires_with_noise_off_and_shuffled_twin_stays_at_chance():
    x, spk, rnd = _uploads(noise_std=0.0)
    positive = _score(x, spk, rnd)
    assert positive.fired and positive.verdict == "fail"
    negative = _score(x, attacks.shuffle_labels(spk, 1), rnd)
    assert not negative.fired
    assert negative.verdict == "pass", negative


def test_speaker_probe_weakens_under_the_dp_view_noise():
    x, spk, rnd = _uploads(n_speakers=20, rounds=30, noise_std=0.0)
    clean = _score(x, spk, rnd)
    noisy = _score(x + np.random.default_rng(3).normal(0, 1.0, x.shape), spk, rnd)
    assert noisy.excess_pp < clean.excess_pp - 50


def test_planted_leak_dose_response_is_monotone_at_the_ends():
    x, spk, rnd = _uploads(n_speakers=20, rounds=30, noise_std=1.0)
    null = attacks.shuffle_labels(spk, 2)
    lo = _score(attacks.plant_label_leak(x, null, 0.0, 4), null, rnd)
    hi = _score(attacks.plant_label_leak(x, null, 1.0, 4), null, rnd)
    assert not lo.fired and hi.fired


def test_linkability_matches_rounds_and_chance_without_signal():
    x, spk, rnd = _uploads(n_speakers=20, rounds=10)
    link = attacks.linkability(x, spk, rnd)
    assert link.accuracy > 0.9 and link.baseline == pytest.approx(1 / 20)
    noise = np.random.default_rng(5).standard_normal(x.shape)
    assert attacks.linkability(noise, spk, rnd).accuracy < 0.2


def test_zero_support_flags_planted_structure_only():
    rng = np.random.default_rng(0)
    t = {"g": rng.standard_normal((30, 4, 8)), "h": np.zeros((30, 3))}
    found = attacks.zero_support(t)
    assert not found["flagged"] and found["constant_zero"][0]["group"] == "h"
    planted = attacks.plant_zero_rows(t, 0.1, seed=1)
    found = attacks.zero_support(planted)
    assert found["flagged"] and found["varying"][0] == {
        "group": "g", "rows": [0], "n_rows": 1, "samples_affected": 3}


def test_masked_partial_sums_are_at_chance_and_unmasked_ones_leak(tmp_path):
    kw = dict(n_speakers=8, languages=4, rounds=30, ranks=8, language_signal=3.0, seed=1)
    for masked in (True, False):
        rec = load_recording(write_synthetic_run(tmp_path / f"m{masked}", mask=masked, **kw))
        labels = partial_labels(rec)
        out = attacks.probe(rec.partials["masked"].astype(np.float64), labels,
                            rec.partials["rounds"], "round")
        g = gate(out.correct, out.n, out.baseline, **GATE)
        assert g.fired is (not masked), g

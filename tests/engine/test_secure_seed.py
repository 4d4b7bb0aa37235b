"""Secure mode runs without a seed: the engine draws one from the OS at start (client randomness)
and writes it nowhere; the record says ``seed: null``, the run id ``ssecure``, the guarantee
``valid``. Cohorts are sampled from a ChaCha20 stream under a 256-bit key rank 0 draws, never
from the drawn seed. (The refusal of an explicit seed is tested with the config, tests/config.)"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch

from engine_helpers import tiny_config

DRAWN = 6_917_529_027_641_081_853  # what the patched CSPRNG hands out


def test_a_secure_run_uses_a_drawn_seed_and_records_none(tiny_corpus, tmp_path, monkeypatch):
    from cluster_fl.engine import cohort, round as round_mod, setup, train

    monkeypatch.setattr(train.secrets, "randbits", lambda bits: DRAWN)
    keys = []
    secure_cohort = round_mod.sample_cohort_secure

    def spy_cohort(key, *args):
        keys.append(key)
        return secure_cohort(key, *args)

    def seeded(*args):
        raise AssertionError("secure mode sampled a cohort from a seed")

    monkeypatch.setattr(round_mod, "sample_cohort_secure", spy_cohort)
    monkeypatch.setattr(cohort, "sample_cohort", seeded)
    seen = {}
    build = setup.build_world

    def spy(cfg, *args, **kwargs):
        seen["seed"] = cfg.run.seed
        return build(cfg, *args, **kwargs)

    monkeypatch.setattr(setup, "build_world", spy)
    torch.set_num_threads(1)
    cfg = tiny_config(tiny_corpus, tmp_path, "privacy.secure_mode=true", "fl.rounds=1")
    assert cfg.run.seed is None
    folder = train.run_training(cfg)
    assert seen["seed"] == DRAWN
    assert len(keys) == 1 and len(keys[0]) == 32  # one round, one 256-bit key
    assert "_ssecure_" in folder.name
    final = pq.read_table(folder / "final.parquet").to_pylist()[0]
    assert final["seed"] is None and final["guarantee"] == "valid"
    assert final["run_id"] == folder.name
    assert json.loads(final["config_json"])["run"]["seed"] is None
    assert "seed: null" in (folder / "config.yaml").read_text()
    for path in folder.rglob("*"):  # the drawn seed and the cohort key are written nowhere
        if path.is_file():
            assert str(DRAWN).encode() not in path.read_bytes(), path
            assert keys[0] not in path.read_bytes(), path

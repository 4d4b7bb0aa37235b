"""The per-round diagnostics release (privacy/diagnostics.py): its sensitivity holds for any input,
and the noise the engine adds and the multiplier the accountant charges come from one place."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cluster_fl.config import load_config
from cluster_fl.privacy import ledger_for, make_policy
from cluster_fl.privacy.diagnostics import Diagnostics, release_multiplier
from privacy_helpers import privacy, speech_groups


def _result(norm: float, clipped: bool, retained: float, pools=("encoder", "decoder")):
    """A clip result as the engine hands it over (only the fields the vector reads)."""
    return SimpleNamespace(nonfinite=False, total_norm=norm, group_norms={},
                           pool_clipped={p: clipped for p in pools},
                           pool_retained={p: retained for p in pools},
                           pool_norms={p: norm for p in pools})


@pytest.mark.parametrize("mode", ["noised", "exact"])
def test_engine_noise_and_accountant_multiplier_are_one_number(mode):
    p = privacy(diagnostics=mode, diagnostics_noise_multiplier=3.0)
    groups = speech_groups()
    diag = Diagnostics(groups, make_policy(p, groups), p)
    cfg = load_config(None, [f"privacy.diagnostics={mode}", "privacy.diagnostics_noise_multiplier=3.0",
                             "fl.clients_per_round=4"])
    charged = ledger_for(cfg, population=100).diagnostics_noise_multiplier
    if mode == "noised":
        # the configured 3.0, charged by the accountant; the engine's std is 3.0 × √D with D the
        # layout's length: 6 head entries + 3 per pool × 2 pools = 12
        assert charged == 3.0 and release_multiplier(p) == 3.0
        assert diag.size == 12 and diag.sensitivity == pytest.approx(math.sqrt(12))
        assert diag.noise_std == pytest.approx(3.0 * math.sqrt(12))
    else:  # exact: nothing noised, nothing charged (the run is void instead)
        assert charged is None and release_multiplier(p) is None and diag.noise_std == 0.0
        assert ledger_for(cfg, population=100).void_reasons


@pytest.mark.parametrize("loss, norm, retained", [(1e30, 1e30, 1.0), (-5.0, 0.0, -3.0),
                                                  (math.nan, math.inf, math.nan), (2.0, 0.3, 0.7)])
def test_a_noised_client_vector_never_exceeds_the_sensitivity(loss, norm, retained):
    p = privacy(diagnostics="noised")
    groups = speech_groups()
    diag = Diagnostics(groups, make_policy(p, groups), p)
    v = diag.client_vector(_result(norm, True, retained), loss)
    assert v.shape == (diag.size,) and bool(torch.isfinite(v).all())
    assert float(v.min()) >= 0.0 and float(v.max()) <= 1.0
    assert float(v.norm()) <= diag.sensitivity

"""The α sweep: measured speaker inference on the encoder channel beside the computed σ/√α.

The view scored is the DP adversary's view of one client's encoder part: its encoder update
clipped by α-split at share α, plus the encoder coordinates of the round's noise N(0, σ²C²). The
noise per coordinate does not depend on α; the clip does (encoder pool threshold √α·C), so the
per-pool effective noise multiplier is σ/√α and the attack should weaken as α shrinks.

The raw update is rebuilt from the recording: every policy clips by scaling a group (or a flat
pool), so raw_h = clipped_h · raw_norm_h / ‖clipped_h‖ exactly (tests check it for every clipping
method). The sweep re-clips it with the real policy (``ClipPolicy.clip``) of ``alpha-split`` at
each α, with the run's inside-pool rule (EMA rules at their base weights).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import torch

from cluster_fl.audit import attacks
from cluster_fl.config import override
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy.clipping import ClipPolicy, make_policy

ALPHAS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.9)


def raw_updates(u: dict) -> tuple[dict[str, np.ndarray], bool]:
    """Per-group raw updates rebuilt from clipped tensors and raw norms (see module doc)."""
    out, exact = {}, True
    for g, c in u["clipped"].items():
        c = c.astype(np.float64)
        flat = c.reshape(len(c), -1)
        norm = np.linalg.norm(flat, axis=1)
        raw = u["raw_norms"].get(g)
        if raw is None:
            out[g], exact = c, False
            continue
        raw = np.nan_to_num(raw, nan=0.0, posinf=0.0)
        factor = np.where(norm > 0, raw / np.maximum(norm, 1e-300), 0.0)
        out[g] = (flat * factor[:, None]).reshape(c.shape)
    return out, exact


def clip_uploads(raw: dict[str, np.ndarray], policy: ClipPolicy) -> dict[str, np.ndarray]:
    """Each recorded client's update (row i of every group) clipped by ``policy.clip``: the
    engine's own clipping, so the sweep's view is what that policy would have uploaded."""
    n = len(next(iter(raw.values()))) if raw else 0
    rows = [policy.clip({g: torch.from_numpy(np.ascontiguousarray(v[i])) for g, v in raw.items()})
            for i in range(n)]
    return {g: np.stack([r.update[g].numpy() for r in rows]) for g in raw}


def alpha_sweep(rec: Any, s: Any, alphas: tuple[float, ...] | None = None) -> list[dict]:
    """One row per α: effective σ, speaker-probe accuracy, gate numbers (empty if no encoder)."""
    u = rec.uploads
    comp = rec.components()
    if u is None or not any(comp.get(g) == "encoder" for g in u["clipped"]):
        return []
    raw, exact = raw_updates(u)
    specs = [GroupSpec(g, comp.get(g, "decoder"), int(np.prod(raw[g].shape[1:])))
             for g in raw]
    enc = [g for g in raw if comp.get(g) == "encoder"]
    sigma, c = s.cfg.privacy.noise_multiplier, s.cfg.privacy.clip_norm
    rule = s.cfg.privacy.inside_pool if s.cfg.privacy.inside_pool != "ema" else "size"
    grouping, groups = attacks.speaker_grouping(u["speakers"], u["client_ids"], u["rounds"])
    rng = np.random.default_rng(s.seed + 7)
    rows = []
    for a in alphas or ALPHAS:
        cfg = override(s.cfg, {"privacy.clipping": "alpha-split", "privacy.alpha": a,
                              "privacy.inside_pool": rule})
        clipped = clip_uploads(raw, make_policy(cfg.privacy, specs))
        x = attacks.flatten_rows([clipped[g] for g in enc])
        x = x + rng.normal(0.0, sigma * c, x.shape)
        out = attacks.probe(x, u["speakers"], np.asarray(groups), grouping, seed=s.seed)
        if out is None:
            continue
        g = s.gate(out)
        rows.append({"alpha": a, "effective_sigma": sigma / math.sqrt(a) if sigma else 0.0,
                     "accuracy": out.accuracy, "baseline": out.baseline,
                     "excess_pp": g.excess_pp, "lower_cp_pp": g.lower_cp_pp,
                     "upper_cp_pp": g.upper_cp_pp, "verdict": g.verdict,
                     "raw_rebuilt_exactly": exact})
    return rows

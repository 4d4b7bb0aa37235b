"""A synthetic run folder with ``channels/`` recordings, for audit tests and engine-free demos.

:func:`write_synthetic_run` writes what the engine writes when ``audit.record_channels`` is true,
with the engine's own writers: config.yaml and status.json (``engine.rundir``), groups.json (the
policy's table), privacy.json (the run ledger, record_channels void reason included), and
channels/uploads_rNNNN_rankK.pt, partial_rNNNN_rankK.pt and release_rNNNN.pt through the engine's
:class:`~cluster_fl.engine.recorder.ChannelRecorder`. The toy model's "updates" are

    Δ_h(client, round) = scale_c · (ε + speaker_signal·u_speaker,h + language_signal·v_language,h)

with ε ~ N(0, I) fresh each round, u/v fixed random directions, scale_c = 0.1 for encoder groups
(the paper's ~10× smaller encoder updates). Updates are clipped with the real policy
(``cluster_fl.privacy.clipping.make_policy``), added per rank to the real
:class:`~cluster_fl.secure_sum.SecureSummer` (fixed point, pairwise masks of the research mode),
whose masked partial is what a peer sees, and released as (Σ + N(0, (noise_scale·σC)²)) / n.

Knobs plant the bugs the audit must see: ``noise_scale < 1`` (noise under-scaled while the record
still claims σC), ``mask=False`` (the summer's plain mode: partial sums in the clear),
``zero_fraction`` (a group exactly zero for that fraction of clients).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from cluster_fl.config import build_config
from cluster_fl.engine.ledger import RunLedger
from cluster_fl.engine.recorder import ChannelRecorder
from cluster_fl.engine.rundir import write_config, write_json, write_status
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy.accounting import ledger_for
from cluster_fl.secure_sum import SecureSummer

LAYOUT = [("enc.q.lora_A", "encoder", (4, 16)), ("enc.v.lora_B", "encoder", (16, 4)),
          ("conn.proj", "connector", (8, 16)), ("dec.q.lora_A", "decoder", (4, 16)),
          ("dec.v.lora_B", "decoder", (16, 4))]
FRACTION_BITS = 32


def synthetic_groups() -> list[GroupSpec]:
    """The toy model's groups (encoder, connector, decoder)."""
    return [GroupSpec(n, c, int(np.prod(s)), s) for n, c, s in LAYOUT]


def write_synthetic_run(run_dir: str | Path, *, n_speakers: int = 24, languages: int = 4,
                        rounds: int = 40, clients_per_round: int | None = None, ranks: int = 4,
                        sigma: float = 1.0, clip_norm: float = 1.0, alpha: float = 0.05,
                        clipping: str = "alpha-split", speaker_signal: float = 1.0,
                        language_signal: float = 1.0, noise_scale: float = 1.0,
                        mask: bool = True, zero_fraction: float = 0.0, canaries: int = 256,
                        margin_pp: float = 1.0, seed: int = 0,
                        privacy: dict[str, Any] | None = None) -> Path:
    """Write a run folder with recorded channels; returns its path. Clients = speakers.
    ``privacy``: further ``privacy.*`` keys (e.g. ``pools``, ``inside_pool``, ``probe_norms``)."""
    from cluster_fl.privacy.clipping import make_policy

    run_dir = Path(run_dir)
    (run_dir / "channels").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    k = clients_per_round or n_speakers
    tree = {"privacy": {"mechanism": "gaussian", "clipping": clipping, "clip_norm": clip_norm,
                        "noise_multiplier": sigma, "alpha": alpha, **(privacy or {})},
            "fl": {"rounds": rounds, "clients_per_round": k, "sampling": "fixed"},
            "aggregation": {"fixed_point_bits": FRACTION_BITS},
            "audit": {"record_channels": True, "canaries": canaries, "margin_pp": margin_pp},
            "run": {"seed": seed, "experiment": "synthetic", "run_id": run_dir.name}}
    cfg = build_config(tree)
    groups = synthetic_groups()
    policy = make_policy(cfg.privacy, groups)
    write_config(run_dir, cfg)
    write_json(run_dir / "groups.json", policy.group_table())
    ledger = RunLedger(ledger_for(cfg, n_speakers), policy, record_channels=True)
    for _ in range(rounds):
        ledger.step_round()
    write_json(run_dir / "privacy.json", ledger.to_json())
    write_status(run_dir, "done", rounds, rounds)
    recorders = [ChannelRecorder(run_dir, rank) for rank in range(ranks)]
    langs = [f"l{i}" for i in range(languages)]
    spk_lang = [langs[i % languages] for i in range(n_speakers)]
    u = {g.name: rng.standard_normal((n_speakers, *g.shape)) / np.sqrt(g.numel) for g in groups}
    v = {g.name: rng.standard_normal((languages, *g.shape)) / np.sqrt(g.numel) for g in groups}
    scale = {g.name: 0.1 if g.component == "encoder" else 1.0 for g in groups}
    zeroed = set(rng.permutation(n_speakers)[:int(round(zero_fraction * n_speakers))].tolist())
    for r in range(1, rounds + 1):
        cohort = np.sort(rng.permutation(n_speakers)[:k])
        total = {g.name: np.zeros(g.shape) for g in groups}
        for rank, recorder in enumerate(recorders):
            summer = SecureSummer({g.name: g.shape for g in groups}, frac_bits=FRACTION_BITS,
                                  max_clients=k, bounds=clip_norm,
                                  mode="research" if mask else "plain", seed=seed)
            for c in cohort[rank::ranks].tolist():
                li = langs.index(spk_lang[c])
                delta = {}
                for g in groups:
                    d = rng.standard_normal(g.shape) / np.sqrt(g.numel) + speaker_signal * \
                        u[g.name][c] + language_signal * v[g.name][li]
                    if c in zeroed and g is groups[-1]:
                        d = np.zeros(g.shape)
                    delta[g.name] = torch.tensor(scale[g.name] * d, dtype=torch.float32)
                res = policy.clip(delta)
                summer.add(res.update)
                client = SimpleNamespace(client_id=f"c{c:03d}", speaker=f"spk{c:03d}",
                                         language=spk_lang[c])
                recorder.upload(r, client, res, SimpleNamespace(n_samples=int(rng.integers(5, 50))))
                for g in groups:
                    total[g.name] += res.update[g.name].double().numpy()
            summer.masked_partial(rank, ranks, r, record=True)  # what a peer sees
            recorder.partial(r, rank, summer)
        std = sigma * clip_norm
        noised = {g.name: torch.tensor((total[g.name] + noise_scale * std * rng.standard_normal(
            g.shape)) / k, dtype=torch.float32) for g in groups}
        recorders[0].release(r, noised, float(k), std)
    return run_dir

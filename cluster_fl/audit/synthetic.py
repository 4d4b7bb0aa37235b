"""A synthetic run folder with ``channels/`` recordings, for audit tests and engine-free demos.

:func:`write_synthetic_run` writes what the engine writes when ``audit.record_channels`` is true
(config.yaml, groups.json, privacy.json, status.json, channels/uploads_rNNNN_rankK.pt,
partial_rNNNN_rankK.pt, release_rNNNN.pt), for a toy model whose "updates" are

    Δ_h(client, round) = scale_c · (ε + speaker_signal·u_speaker,h + language_signal·v_language,h)

with ε ~ N(0, I) fresh each round, u/v fixed random directions, scale_c = 0.1 for encoder groups
(the paper's ~10× smaller encoder updates). Updates are clipped with the real policy
(``cluster_fl.privacy.clipping.make_policy``), summed per rank, fixed-point encoded and masked with
pairwise-cancelling int64 masks, and released as (Σ + N(0, (noise_scale·σC)²)) / n.

Knobs plant the bugs the audit must see: ``noise_scale < 1`` (noise under-scaled while the record
still claims σC), ``mask=False`` (partial sums in the clear), ``zero_fraction`` (a group exactly zero
for that fraction of clients). The integrator may reuse it to test the engine's recordings against
the audit, file for file.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

from cluster_fl.config import build_config, dump_config
from cluster_fl.groups import GroupSpec

LAYOUT = [("enc.q.lora_A", "encoder", (4, 16)), ("enc.v.lora_B", "encoder", (16, 4)),
          ("conn.proj", "connector", (8, 16)), ("dec.q.lora_A", "decoder", (4, 16)),
          ("dec.v.lora_B", "decoder", (16, 4))]
FRACTION_BITS = 32


def _save(path: Path, obj: object) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(buf.getvalue())


def synthetic_groups() -> list[GroupSpec]:
    """The toy model's groups (encoder, connector, decoder)."""
    return [GroupSpec(n, c, int(np.prod(s)), s) for n, c, s in LAYOUT]


def _mask_partials(plain: list[np.ndarray], rng: np.random.Generator,
                   mask: bool) -> list[np.ndarray]:
    """Fixed-point encode and add int64 masks that cancel over ranks (mod 2⁶⁴)."""
    enc = [np.round(p * 2.0 ** FRACTION_BITS).astype(np.int64).view(np.uint64) for p in plain]
    if not mask:
        return [e.view(np.int64) for e in enc]
    masks = [rng.integers(0, 2 ** 64, size=enc[0].shape, dtype=np.uint64)
             for _ in range(len(enc) - 1)]
    with np.errstate(over="ignore"):
        masks.append(np.uint64(0) - np.sum(masks, axis=0, dtype=np.uint64) if masks
                     else np.zeros_like(enc[0]))
        return [(e + m).view(np.int64) for e, m in zip(enc, masks)]


def write_synthetic_run(run_dir: str | Path, *, n_speakers: int = 24, languages: int = 4,
                        rounds: int = 40, clients_per_round: int | None = None, ranks: int = 4,
                        sigma: float = 1.0, clip_norm: float = 1.0, alpha: float = 0.05,
                        clipping: str = "alpha-split", speaker_signal: float = 1.0,
                        language_signal: float = 1.0, noise_scale: float = 1.0,
                        mask: bool = True, zero_fraction: float = 0.0, canaries: int = 256,
                        margin_pp: float = 1.0, seed: int = 0) -> Path:
    """Write a run folder with recorded channels; returns its path. Clients = speakers."""
    from cluster_fl.privacy.clipping import make_policy

    run_dir = Path(run_dir)
    (run_dir / "channels").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    k = clients_per_round or n_speakers
    tree = {"privacy": {"mechanism": "gaussian", "clipping": clipping, "clip_norm": clip_norm,
                        "noise_multiplier": sigma, "alpha": alpha},
            "fl": {"rounds": rounds, "clients_per_round": k, "sampling": "fixed"},
            "audit": {"record_channels": True, "canaries": canaries, "margin_pp": margin_pp},
            "run": {"seed": seed, "experiment": "synthetic", "run_id": run_dir.name}}
    cfg = build_config(tree)
    groups = synthetic_groups()
    policy = make_policy(cfg.privacy, groups)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "groups.json").write_text(json.dumps(policy.group_table(), indent=1))
    (run_dir / "status.json").write_text(json.dumps({"state": "done", "round": rounds,
                                                     "rounds": rounds, "error": None}))
    (run_dir / "privacy.json").write_text(json.dumps(
        {"accountant": cfg.privacy.accountant, "noise_multiplier": sigma, "rounds": rounds,
         "delta": cfg.privacy.delta, "sampling_rate": 1.0, "guarantee": "valid"}))
    langs = [f"l{i}" for i in range(languages)]
    spk_lang = [langs[i % languages] for i in range(n_speakers)]
    u = {g.name: rng.standard_normal((n_speakers, *g.shape)) / np.sqrt(g.numel) for g in groups}
    v = {g.name: rng.standard_normal((languages, *g.shape)) / np.sqrt(g.numel) for g in groups}
    scale = {g.name: 0.1 if g.component == "encoder" else 1.0 for g in groups}
    zeroed = set(rng.permutation(n_speakers)[:int(round(zero_fraction * n_speakers))].tolist())
    for r in range(1, rounds + 1):
        cohort = np.sort(rng.permutation(n_speakers)[:k])
        per_rank = [cohort[i::ranks] for i in range(ranks)]
        plain_sums, total = [], {g.name: np.zeros(g.shape) for g in groups}
        for rank, members in enumerate(per_rank):
            rec = {"client_ids": [], "speakers": [], "languages": [], "clipped": {},
                   "raw_norms": {}, "n_samples": []}
            psum = {g.name: np.zeros(g.shape) for g in groups}
            for c in members.tolist():
                li = langs.index(spk_lang[c])
                delta = {}
                for g in groups:
                    d = rng.standard_normal(g.shape) / np.sqrt(g.numel) + speaker_signal * \
                        u[g.name][c] + language_signal * v[g.name][li]
                    if c in zeroed and g is groups[-1]:
                        d = np.zeros(g.shape)
                    delta[g.name] = torch.tensor(scale[g.name] * d, dtype=torch.float32)
                res = policy.clip(delta)
                rec["client_ids"].append(f"c{c:03d}")
                rec["speakers"].append(f"spk{c:03d}")
                rec["languages"].append(spk_lang[c])
                rec["n_samples"].append(int(rng.integers(5, 50)))
                for g in groups:
                    t = res.update[g.name].to(torch.float32)
                    rec["clipped"].setdefault(g.name, []).append(t)
                    rec["raw_norms"].setdefault(g.name, []).append(res.group_norms[g.name])
                    psum[g.name] += t.double().numpy()
            rec["clipped"] = {n: torch.stack(t) for n, t in rec["clipped"].items()}
            rec["raw_norms"] = {n: torch.tensor(t) for n, t in rec["raw_norms"].items()}
            rec["n_samples"] = torch.tensor(rec["n_samples"])
            if len(members):
                _save(run_dir / "channels" / f"uploads_r{r:04d}_rank{rank}.pt", rec)
            plain_sums.append(np.concatenate([psum[g.name].ravel() for g in groups]))
            for g in groups:
                total[g.name] += psum[g.name]
        masked = _mask_partials(plain_sums, rng, mask)
        for rank in range(ranks):
            _save(run_dir / "channels" / f"partial_r{r:04d}_rank{rank}.pt",
                  {"masked": torch.from_numpy(masked[rank].copy()),
                   "plain": {"flat": torch.from_numpy(plain_sums[rank].copy())}})
        std = sigma * clip_norm
        noised = {g.name: torch.tensor((total[g.name] + noise_scale * std * rng.standard_normal(
            g.shape)) / k, dtype=torch.float32) for g in groups}
        _save(run_dir / "channels" / f"release_r{r:04d}.pt",
              {"noised_mean": noised, "noise_std": std, "denominator": float(k)})
    return run_dir

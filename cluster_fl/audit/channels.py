"""The declared channels of a run and the loader for its ``channels/`` recordings.

A privacy claim covers only the channels it names, so the list is fixed here, per run, before any
attack is scored: :data:`CHANNELS` names every observer view and :data:`BATTERY` every
(channel, attack) cell, measured or not. The report walks this list, so a channel can never drop
out silently -- an attack that cannot run says ``not measured`` and why.

Recording formats accepted (``<run>/channels/``, torch ``.pt``):
* ``uploads_rNNNN.pt`` or ``uploads_rNNNN_rankK.pt`` (per rank; merged, rank kept):
  {client_ids, speakers, languages, [groups], clipped {group: [n, *shape]}, raw_norms {group: [n]},
  n_samples [n]};
* ``partial_rNNNN_rankK.pt``: {"masked": int64 tensor, "plain": {group: tensor}} (or a bare
  masked tensor);
* ``release_rNNNN.pt``: {noised_mean {group: tensor}, [noise_std], denominator}.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cluster_fl.errors import UserError

# channel -> (observer, what they see)
CHANNELS: dict[str, tuple[str, str]] = {
    "uploads": ("curious server without secure sum",
                "each client's clipped update, every round"),
    "partial_sums": ("a peer rank", "each rank's masked fixed-point partial sum"),
    "release": ("anyone", "the noised mean update applied after every round"),
    "side_stats": ("the server / anyone reading the run record",
                   "per-client raw norms and sample counts; clip rates, adaptive thresholds; "
                   "in the released folder: no exact count (realised cohort, empty rounds, "
                   "skipped rows) and no timing may appear"),
}

# (channel, attack, gated) in report order; gated cells share the Bonferroni family.
BATTERY: list[tuple[str, str, bool]] = [
    ("uploads", "speaker_probe/encoder", True),
    ("uploads", "speaker_probe/decoder", True),
    ("uploads", "language_probe/encoder", True),
    ("uploads", "language_probe/decoder", True),
    ("uploads", "linkability", True),
    ("uploads", "zero_support", False),
    ("partial_sums", "language_probe/masked", True),
    ("partial_sums", "zero_support", False),
    ("release", "canary_epsilon", False),
    ("release", "speaker_probe", False),
    ("release", "zero_support", False),
    ("side_stats", "speaker_probe/norms_counts", True),
    ("side_stats", "language_probe/norms_counts", True),
    ("side_stats", "adaptive_thresholds", False),
    ("side_stats", "exact_counts", False),
    ("side_stats", "timing", False),
]


def battery_size() -> int:
    """m for the Bonferroni split: gated cells declared, whether or not they can run."""
    return sum(1 for _, _, g in BATTERY if g)


_NAME = re.compile(r"^(uploads|partial|release)_r(\d{4,})(?:_rank(\d+))?\.pt$")


@dataclass
class Recording:
    """What the run recorded, as numpy arrays concatenated over rounds."""

    run_dir: Path
    groups: list[dict] = field(default_factory=list)
    uploads: dict[str, Any] | None = None
    partials: dict[str, Any] | None = None
    releases: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def components(self) -> dict[str, str]:
        """Group name → component."""
        return {g["name"]: g["component"] for g in self.groups}


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)  # data, never code


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def load_recording(run_dir: str | Path) -> Recording:
    """Read ``groups.json`` and every file under ``channels/``; missing parts stay None."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run folder not found: {run_dir}")
    rec = Recording(run_dir)
    if (run_dir / "groups.json").is_file():
        rec.groups = json.loads((run_dir / "groups.json").read_text())
    chan = run_dir / "channels"
    files: dict[str, list[tuple[int, int, Path]]] = {"uploads": [], "partial": [], "release": []}
    if chan.is_dir():
        for p in sorted(chan.iterdir()):
            m = _NAME.match(p.name)
            if m:
                files[m.group(1)].append((int(m.group(2)), int(m.group(3) or 0), p))
    if files["uploads"]:
        rec.uploads = _merge_uploads(files["uploads"], rec)
    if files["partial"]:
        rec.partials = _merge_partials(files["partial"], rec)
    if files["release"]:
        rec.releases = _merge_releases(files["release"])
    return rec


def _merge_uploads(items: list[tuple[int, int, Path]], rec: Recording) -> dict[str, Any]:
    cols: dict[str, list] = {k: [] for k in ("client_ids", "speakers", "languages", "rounds",
                                             "ranks", "n_samples")}
    clipped: dict[str, list] = {}
    raw: dict[str, list] = {}
    for rnd, rank, path in sorted(items):
        u = _load(path)
        n = len(u["client_ids"])
        if not rec.groups and u.get("groups"):
            rec.groups = [dict(g) for g in u["groups"]]
        for k in ("client_ids", "speakers", "languages"):
            cols[k].extend([str(v) for v in u[k]])
        cols["rounds"].extend([rnd] * n)
        cols["ranks"].extend([rank] * n)
        cols["n_samples"].extend(_np(u.get("n_samples", np.ones(n))).tolist())
        for g, t in u["clipped"].items():
            clipped.setdefault(g, []).append(_np(t).astype(np.float32))
        for g, t in u.get("raw_norms", {}).items():
            raw.setdefault(g, []).append(_np(t).astype(np.float64))
    out: dict[str, Any] = {k: np.asarray(v) for k, v in cols.items()}
    out["clipped"] = {g: np.concatenate(v) for g, v in clipped.items()}
    out["raw_norms"] = {g: np.concatenate(v) for g, v in raw.items()}
    if not rec.groups:
        rec.groups = [{"name": g, "component": "unknown", "numel": int(v[0][0].size)}
                      for g, v in clipped.items()]
        rec.notes.append("groups.json missing: components unknown, encoder/decoder split off")
    return out


def _merge_partials(items: list[tuple[int, int, Path]], rec: Recording) -> dict[str, Any]:
    rounds, ranks, masked, plain = [], [], [], []
    for rnd, rank, path in sorted(items):
        p = _load(path)
        m = p.get("masked") if isinstance(p, dict) else p
        if m is None:
            continue
        rounds.append(rnd)
        ranks.append(rank)
        masked.append(_np(m).reshape(-1))
        if isinstance(p, dict) and p.get("plain") is not None:
            plain.append(np.concatenate([_np(v).reshape(-1).astype(np.float64)
                                         for v in p["plain"].values()]))
    if not masked:
        return None  # type: ignore[return-value]
    out = {"rounds": np.asarray(rounds), "ranks": np.asarray(ranks),
           "masked": np.stack(masked), "plain": np.stack(plain) if len(plain) == len(masked)
           else None}
    return out


def _merge_releases(items: list[tuple[int, int, Path]]) -> dict[str, Any]:
    rounds, stds, dens, means = [], [], [], {}
    for rnd, _, path in sorted(items):
        r = _load(path)
        rounds.append(rnd)
        stds.append(float(r["noise_std"]) if r.get("noise_std") is not None else np.nan)
        dens.append(float(r["denominator"]))
        for g, t in r["noised_mean"].items():
            means.setdefault(g, []).append(_np(t).astype(np.float64))
    return {"rounds": np.asarray(rounds), "noise_std": np.asarray(stds),
            "denominator": np.asarray(dens),
            "noised_mean": {g: np.stack(v) for g, v in means.items()}}


def partial_labels(rec: Recording) -> np.ndarray | None:
    """Majority language of the clients a partial sum covers, per (round, rank) partial.

    Needs per-rank upload files (which clients each rank held); None otherwise.
    """
    if rec.partials is None or rec.uploads is None:
        return None
    u = rec.uploads
    labels = []
    for rnd, rank in zip(rec.partials["rounds"], rec.partials["ranks"]):
        sel = (u["rounds"] == rnd) & (u["ranks"] == rank)
        if not sel.any():
            return None
        labels.append(Counter(u["languages"][sel].tolist()).most_common(1)[0][0])
    return np.asarray(labels)

"""Attacks that fit speech and run on CPU: linear probes, cross-round linkability, zero support.

Every attack here maps a feature matrix (one row per observed object: a client's upload, a rank's
partial sum) and labels to a count of correct guesses, the number of guesses and the constant-guess
baseline -- the three numbers the gate in :mod:`cluster_fl.audit.stats` needs. Planting helpers
(:func:`plant_label_leak`, :func:`shuffle_labels`) build the positive and negative controls from the
same features, so the controls see the same distribution as the real attack.

Probes are ridge classifiers (one-vs-rest, closed form, numpy) on a fixed random projection of the
update; they are cross-validated with grouped folds:

* language (and any label shared by several clients): folds BY CLIENT -- a client's updates are
  never in both train and test, so the probe must generalise to unseen speakers;
* speaker identity when every speaker is one client (MLS: clients = speakers): a by-client split
  can never predict an unseen identity, so folds are BY ROUND instead -- the curious server learns a
  speaker's updates in some rounds and recognises the speaker in held-out rounds. The grouping used
  is returned and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from cluster_fl.audit.stats import constant_baseline

PROJECTION_DIM = 256
RIDGE = 10.0


@dataclass
class AttackOutcome:
    """Counts that feed the gate, plus how they were obtained."""

    correct: int
    n: int
    baseline: float
    grouping: str

    @property
    def accuracy(self) -> float:
        """Fraction of correct guesses."""
        return self.correct / self.n if self.n else 0.0


def flatten_rows(tensors: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate per-sample slices of several ``[n, *shape]`` arrays into ``[n, d]`` float64."""
    parts = [np.asarray(t).reshape(len(t), -1).astype(np.float64) for t in tensors]
    return np.concatenate(parts, axis=1) if parts else np.zeros((0, 0))


def project(x: np.ndarray, dim: int = PROJECTION_DIM, seed: int = 0) -> np.ndarray:
    """Fixed Gaussian random projection to ``dim`` columns (identity when already smaller).

    Johnson–Lindenstrauss keeps linear structure, and it bounds the probe's cost for large LoRA
    groups. The seed is fixed so every arm of an attack sees the same projection.
    """
    x = np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if x.shape[1] <= dim:
        return x
    rng = np.random.default_rng(seed)
    out = np.zeros((x.shape[0], dim))
    step = 4096  # project in column blocks: never materialise a d × dim matrix for huge d
    for s in range(0, x.shape[1], step):
        block = x[:, s:s + step]
        proj = torch.from_numpy(rng.standard_normal((block.shape[1], dim)))
        out += (torch.from_numpy(np.ascontiguousarray(block)) @ proj).numpy()
    return out / np.sqrt(dim)


def grouped_folds(groups: Sequence, k: int = 5, seed: int = 0) -> np.ndarray:
    """Fold index per sample such that samples with the same group share a fold."""
    uniq = np.unique(np.asarray(groups))
    rng = np.random.default_rng(seed)
    fold_of = dict(zip(uniq.tolist(), (rng.permutation(len(uniq)) % min(k, len(uniq))).tolist()))
    return np.array([fold_of[g] for g in np.asarray(groups).tolist()])


def ridge_cv_predict(x: np.ndarray, y: Sequence, folds: np.ndarray,
                     ridge: float = RIDGE) -> np.ndarray:
    """Out-of-fold predictions of a one-vs-rest ridge classifier (standardised on train only)."""
    y = np.asarray(y)
    classes, yi = np.unique(y, return_inverse=True)
    pred = np.empty(len(y), dtype=y.dtype)
    for f in np.unique(folds):
        tr, te = folds != f, folds == f
        mu, sd = x[tr].mean(0), x[tr].std(0)
        sd[sd == 0] = 1.0
        xtr, xte = (x[tr] - mu) / sd, (x[te] - mu) / sd
        onehot = np.eye(len(classes))[yi[tr]]
        onehot -= onehot.mean(0)
        # torch, not numpy: its thread count is controllable (OpenBLAS oversubscribes 2 cores)
        a, b = torch.from_numpy(xtr), torch.from_numpy(onehot)
        w = torch.linalg.solve(a.T @ a + ridge * torch.eye(x.shape[1], dtype=a.dtype), a.T @ b)
        scores = (torch.from_numpy(xte) @ w).numpy()
        seen = np.zeros(len(classes), bool)
        seen[np.unique(yi[tr])] = True
        scores[:, ~seen] = -np.inf  # a class absent from training cannot be guessed
        pred[te] = classes[scores.argmax(1)]
    return pred


def probe(x: np.ndarray, labels: Sequence, groups: Sequence, grouping: str,
          k: int = 5, seed: int = 0) -> AttackOutcome | None:
    """Grouped-CV linear probe; None when fewer than two groups or one label (nothing to learn)."""
    labels = np.asarray(labels)
    if len(np.unique(groups)) < 2 or len(np.unique(labels)) < 2:
        return None
    pred = ridge_cv_predict(project(x, seed=seed), labels, grouped_folds(groups, k, seed))
    return AttackOutcome(int((pred == labels).sum()), len(labels), constant_baseline(labels),
                         grouping)


def speaker_grouping(speakers: Sequence, clients: Sequence, rounds: Sequence) -> tuple[str, list]:
    """Folds for a speaker probe: by client when speakers span clients, else by round (see top)."""
    spk, cli = np.asarray(speakers), np.asarray(clients)
    spans = all(len(np.unique(cli[spk == s])) >= 2 for s in np.unique(spk))
    return ("client", list(clients)) if spans else ("round", list(rounds))


def shuffle_labels(labels: Sequence, seed: int) -> np.ndarray:
    """Per-sample permutation of labels: the negative-control twin (keeps the label marginals)."""
    return np.random.default_rng(seed).permutation(np.asarray(labels))


def plant_label_leak(x: np.ndarray, labels: Sequence, dose: float, seed: int) -> np.ndarray:
    """Add ``dose`` × (median row norm) × u_label: a known leak of the label into every row.

    u_label is a random unit direction per label value; dose 0 returns the rows unchanged.
    """
    labels = np.asarray(labels)
    if dose == 0:
        return x
    rng = np.random.default_rng(seed)
    uniq, inv = np.unique(labels, return_inverse=True)
    dirs = rng.standard_normal((len(uniq), x.shape[1]))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    scale = float(np.median(np.linalg.norm(x, axis=1))) or 1.0
    return x + dose * scale * dirs[inv]


def linkability(x: np.ndarray, clients: Sequence, rounds: Sequence) -> AttackOutcome | None:
    """Match each client's row in round r to its row in the next round it appears with others.

    For consecutive observed rounds (r, r'), every client present in both is a query; the guess is
    the most cosine-similar row of round r'. Baseline: mean over queries of 1/|candidates|, the
    accuracy of a uniform guess (the counts are Poisson-binomial under the null; the CP bound on
    their mean is the usual approximation).
    """
    x = project(x)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    cli, rnd = np.asarray(clients), np.asarray(rounds)
    order = np.unique(rnd)
    correct = n = 0
    chance = 0.0
    for r, r2 in zip(order[:-1], order[1:]):
        a, b = np.where(rnd == r)[0], np.where(rnd == r2)[0]
        if len(b) < 2:
            continue
        sims = (torch.from_numpy(x[a]) @ torch.from_numpy(x[b]).T).numpy()
        for i, ai in enumerate(a):
            if cli[ai] not in set(cli[b].tolist()):
                continue
            n += 1
            chance += 1.0 / len(b)
            correct += int(cli[b[int(sims[i].argmax())]] == cli[ai])
    if n == 0:
        return None
    return AttackOutcome(correct, n, chance / n, "consecutive rounds")


def zero_support(tensors: Mapping[str, np.ndarray]) -> dict:
    """Exact-zero support patterns across samples, per group and per row.

    A group (or a row of a matrix group) that is exactly zero for some samples and not for others
    is *informative*: the pattern itself says something about the sample (skipped / non-finite
    client, frozen part, which rows were real). Patterns that are the same for every sample are
    listed as constant, not flagged. Returns ``{"flagged": bool, "varying": [...],
    "constant_zero": [...], "n": samples}``.
    """
    varying, constant = [], []
    n = 0
    for name, t in tensors.items():
        t = np.asarray(t)
        n = max(n, len(t))
        rows = t.reshape(len(t), t.shape[1], -1) if t.ndim >= 3 else t.reshape(len(t), 1, -1)
        zero_rows = ~np.any(rows != 0, axis=2)  # [samples, rows]; NaN counts as nonzero
        frac = zero_rows.mean(0)
        var_rows = np.where((frac > 0) & (frac < 1))[0]
        if len(var_rows):
            varying.append({"group": name, "rows": var_rows[:20].tolist(),
                            "n_rows": int(len(var_rows)),
                            "samples_affected": int(zero_rows[:, var_rows].any(1).sum())})
        elif frac.size and frac.max() == 1:
            constant.append({"group": name, "n_rows": int((frac == 1).sum())})
    return {"flagged": bool(varying), "varying": varying, "constant_zero": constant, "n": n}


def plant_zero_rows(tensors: Mapping[str, np.ndarray], fraction: float,
                    seed: int) -> dict[str, np.ndarray]:
    """Zero the first row of the first group for a ``fraction`` of samples (structural control)."""
    out = {k: np.array(v, copy=True) for k, v in tensors.items()}
    if fraction <= 0 or not out:
        return out
    name = next(iter(out))
    n = len(out[name])
    pick = np.random.default_rng(seed).permutation(n)[:max(1, int(round(fraction * n)))]
    view = out[name].reshape(n, out[name].shape[1] if out[name].ndim >= 3 else 1, -1)
    view[pick, 0, :] = 0
    out[name] = view.reshape(out[name].shape)
    return out

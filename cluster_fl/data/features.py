"""Whisper-style log-mel features, computed once per corpus shard and cached on disk.

Features follow Whisper's extractor: 16 kHz, n_fft 400 (25 ms), hop 160 (10 ms), periodic Hann
window, centred reflect-padded STFT without its last frame, power spectrum, Slaney mel filters,
``log10(max(mel, 1e-10))`` clamped to (max - 8) and scaled as ``(x + 4) / 4``. Written in torch
(no torchaudio) so it runs wherever the models do.

Cache: ``<cache>/<params hash>/<lang>/<split>/<shard file stem>.pt`` holds the features (float16,
half the disk and memory) of every decodable row of one shard, keyed by utterance id, and the rows
that could not be used with their reasons. A cache file is used only for the same parameters (the
folder's hash covers them, so changing ``n_mels`` never reads stale files) and the same audio: it
records the shard file's SHA-256, and a shard whose size or modification time differ from the
recorded ones is hashed again -- changed content means the features are computed anew.
``FEATURE_VERSION`` 2 introduced the content key: caches of version 1 (keyed by path only) are
no longer read and can be deleted. Files are written atomically (tmp + rename); a cache that cannot
be written is a one-line error naming it. Rows whose audio cannot be decoded are reported (also
when their shard's features come from the cache) and skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from cluster_fl.data.mls import (Client, Shard, Utterance, file_sha256, load_utterances,
                                 read_shard, report_problem)
from cluster_fl.errors import UserError


def _source(path: str | Path, sha256: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}

N_FFT, HOP, SAMPLE_RATE = 400, 160, 16000
FEATURE_VERSION = 2  # 2: keyed by the shard's content hash; unusable rows kept with the features


def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sr: int = SAMPLE_RATE) -> torch.Tensor:
    """Slaney-scale, Slaney-normalised mel filterbank [n_mels, n_fft // 2 + 1] (librosa's)."""
    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        mel = f / (200.0 / 3)
        log_part = f >= 1000.0
        return np.where(log_part, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4)
                                                                                 / 27.0), mel)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)),
                        m * (200.0 / 3))

    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_pts = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    fdiff = np.diff(mel_pts)
    ramps = mel_pts[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_pts[2:n_mels + 2] - mel_pts[:n_mels]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


_FILTERS: dict[int, torch.Tensor] = {}


def log_mel(audio: np.ndarray | torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """Whisper-normalised log-mel spectrogram [n_mels, frames] (frames = len // 160)."""
    x = torch.as_tensor(audio, dtype=torch.float32)
    if n_mels not in _FILTERS:
        _FILTERS[n_mels] = mel_filters(n_mels)
    window = torch.hann_window(N_FFT)
    spec = torch.stft(x, N_FFT, HOP, window=window, return_complex=True)[..., :-1]
    mel = _FILTERS[n_mels] @ spec.abs() ** 2
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


@dataclass
class Example:
    """A training/eval example: features [n_mels, frames] (float16) and its labels."""

    features: torch.Tensor
    transcript: str
    utterance_id: str
    speaker: str
    language: str


class FeatureStore:
    """Cached log-mel features of a corpus: ``examples``, ``split`` and ``client`` views."""

    def __init__(self, root: str | Path, cache_dir: str | Path | None = None,
                 n_mels: int = 80, progress: bool = True) -> None:
        self.root = Path(root).expanduser()
        self.n_mels = n_mels
        params = {"n_mels": n_mels, "n_fft": N_FFT, "hop": HOP, "sr": SAMPLE_RATE,
                  "version": FEATURE_VERSION}
        self.params_hash = hashlib.sha256(json.dumps(params, sort_keys=True).encode()
                                          ).hexdigest()[:12]
        base = Path(cache_dir).expanduser() if cache_dir else self.root / "features"
        self.cache_dir = base / self.params_hash
        self.computed_shards = 0  # shards whose features were computed (not read) here
        self.errors: list[dict] = []  # unusable rows, each once: {utterance_id, shard, reason}
        self._reported: set[str] = set()
        self._memory: dict[str, dict[str, torch.Tensor]] = {}
        self.progress = progress
        self._last_report = time.monotonic()

    @classmethod
    def from_config(cls, data_cfg: Any) -> "FeatureStore":
        """The store for a resolved ``DataConfig`` (corpus, feature_cache, n_mels). ``n_mels`` 0
        (the model's) must have been resolved first (``models.registry.resolve_shapes``): the
        data layer does not know the model, and guessing is how 80-bin features once met a
        128-bin encoder."""
        n_mels = getattr(data_cfg, "n_mels", 0)
        if not n_mels:
            raise ValueError("data.n_mels is 0 (the model's): resolve the config with "
                             "cluster_fl.models.registry.resolve_shapes before computing features")
        return cls(data_cfg.corpus, data_cfg.feature_cache, n_mels)

    def _cache_path(self, shard_path: str) -> Path:
        rel = Path(shard_path).resolve().relative_to(self.root.resolve())
        return self.cache_dir / rel.with_suffix(".pt")

    def shard_features(self, shard: Shard) -> dict[str, torch.Tensor]:
        """utterance id -> features for one shard: memory, then disk, else computed and saved."""
        if shard.path in self._memory:
            return self._memory[shard.path]
        path = self._cache_path(shard.path)
        feats, skipped = None, []
        if path.exists():
            try:
                blob = torch.load(path, weights_only=True)
                if blob.get("params_hash") == self.params_hash and self._same_audio(shard, blob,
                                                                                    path):
                    feats = dict(zip(blob["utterance_ids"], blob["features"]))
                    skipped = list(blob.get("skipped", []))
                    for e in skipped:  # reported again: the run must know what it did not use
                        self._report(e, warn=True)
            except Exception:  # a damaged cache file is recomputed, never trusted
                feats = None
        if feats is None:
            feats, skipped = {}, []
            sha256 = file_sha256(shard.path)  # before reading: a later change re-keys it
            for utt in read_shard(shard, decode=True, errors=skipped):
                feats[utt.utterance_id] = log_mel(utt.audio, self.n_mels).to(torch.float16)
            for e in skipped:
                self._report(e, warn=False)  # read_shard has warned
            self._save(path, {"params_hash": self.params_hash,
                              "source": _source(shard.path, sha256),
                              "utterance_ids": list(feats), "features": list(feats.values()),
                              "skipped": skipped})
            self.computed_shards += 1
            if self.progress and time.monotonic() - self._last_report > 5:
                print(f"features: {self.computed_shards} shard(s) computed, last {shard.path}",
                      file=sys.stderr, flush=True)
                self._last_report = time.monotonic()
        self._memory[shard.path] = feats
        return feats

    def _same_audio(self, shard: Shard, blob: dict, path: Path) -> bool:
        """The cached features were computed from this shard's current bytes. Size and
        modification time unchanged: the recorded hash stands; otherwise the file is hashed."""
        source = blob.get("source") or {}
        st = os.stat(shard.path)
        if (source.get("size"), source.get("mtime_ns")) == (st.st_size, st.st_mtime_ns):
            return bool(source.get("sha256"))
        sha256 = file_sha256(shard.path)
        if sha256 != source.get("sha256"):
            return False
        try:  # same bytes, touched: remember the new stat so the next read need not hash
            self._save(path, {**blob, "source": _source(shard.path, sha256)})
        except UserError:
            pass
        return True

    def _save(self, path: Path, blob: dict) -> None:
        """Atomic write of one cache file; a failure (full disk, read-only) names the file."""
        import io

        buf = io.BytesIO()
        torch.save(blob, buf)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(buf.getbuffer())
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise UserError(f"data.feature_cache: cannot write {path}: "
                            f"{exc.strerror or exc}") from None

    def _report(self, entry: dict, warn: bool) -> None:
        uid = str(entry.get("utterance_id"))
        if uid in self._reported:
            return
        self._reported.add(uid)
        if warn:
            report_problem(self.errors, uid, str(entry.get("shard")), str(entry.get("reason")))
        else:
            self.errors.append(dict(entry))

    def examples(self, utterances: Sequence[Utterance]) -> list[Example]:
        """Examples for ``utterances`` in their order; rows without features are skipped."""
        out = []
        for u in utterances:
            feats = self.shard_features(Shard(u.shard, u.language, u.split))
            f = feats.get(u.utterance_id)
            if f is None:
                self._report({"utterance_id": u.utterance_id, "shard": u.shard,
                              "reason": "no cached features"}, warn=True)
                continue
            out.append(Example(f, u.transcript, u.utterance_id, u.speaker, u.language))
        return out

    def split(self, split: str, languages: Sequence[str] | None = None,
              max_utterances: int = 0) -> list[Example]:
        """Examples of a whole split (e.g. ``public`` for pretraining, ``test`` for WER)."""
        return self.examples(load_utterances(self.root, languages, [split], max_utterances))

    def client(self, client: Client) -> list[Example]:
        """Examples of one federated client."""
        return self.examples(client.utterances)

    def release(self) -> None:
        """Forget the in-memory copies (the disk cache stays)."""
        self._memory.clear()


def pad_examples(examples: Sequence[Example], pad_value: float | None = None) -> dict[str, Any]:
    """Pad a batch: features float32 [B, n_mels, T_max], lengths int64 [B] and the labels.

    ``pad_value=None`` pads each example with its own minimum (its silence level after
    Whisper's clamp), so padding looks like silence rather than a cliff.
    """
    if not examples:
        raise ValueError("pad_examples needs at least one example")
    lengths = torch.tensor([e.features.shape[-1] for e in examples], dtype=torch.int64)
    n_mels = examples[0].features.shape[0]
    batch = torch.empty(len(examples), n_mels, int(lengths.max()), dtype=torch.float32)
    for i, e in enumerate(examples):
        f = e.features.float()
        batch[i, :, :f.shape[-1]] = f
        batch[i, :, f.shape[-1]:] = f.min() if pad_value is None else pad_value
    return {"features": batch, "lengths": lengths,
            "transcripts": [e.transcript for e in examples],
            "utterance_ids": [e.utterance_id for e in examples],
            "speakers": [e.speaker for e in examples],
            "languages": [e.language for e in examples]}

"""Whisper-style log-mel features, the example they make, and padded batches.

Features follow Whisper's extractor: 16 kHz, n_fft 400 (25 ms), hop 160 (10 ms), periodic Hann
window, centred reflect-padded STFT without its last frame, power spectrum, Slaney mel filters,
``log10(max(mel, 1e-10))`` clamped to (max - 8) and scaled as ``(x + 4) / 4``. Written in torch
(no torchaudio) so it runs wherever the models do.

Where the features are kept (per speaker, an index per shard, read one client at a time) is
:mod:`cluster_fl.data.store`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

N_FFT, HOP, SAMPLE_RATE = 400, 160, 16000


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

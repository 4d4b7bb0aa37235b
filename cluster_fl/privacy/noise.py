"""Gaussian noise for the summed update (and the summed adaptive statistic), drawn ONCE.

Threat model. The aggregator (rank 0's noise step) is trusted; what leaves it is the noised sum.
Two modes:

* research (``ResearchNoise``): every draw is a deterministic function of (seed, round, stream),
  via a ``torch.Generator`` seeded from SHA-256 of those. Reproducible and independent of the
  number of ranks, but anyone who knows the seed can subtract the noise: NOT a privacy guarantee
  against an observer who holds the run folder (its config records the seed). Runs record their
  guarantee as ``simulation`` (``privacy.accounting``). The round engine scopes every stream by
  the run's identity, so two grid cells that share a seed never share noise.
* secure (``SecureNoise``): every draw reads a ChaCha20 keystream under a fresh 256-bit key from
  the OS CSPRNG (:mod:`cluster_fl.privacy.csprng`); refuses a seed. Against floating-point attacks
  on the Gaussian sampler (Mironov 2012; Jin et al. 2022) each sample is the sum of 2n = 4
  independent N(0, std²/4) draws, accumulated in float64 -- the construction Opacus' secure mode
  uses (Holohan & Braghin 2021) -- so the low-order bits of a released value no longer reveal
  which base sample produced it. Noise is never cast below float32 before release.

Tails: no draw exceeds ``TAIL_STDS`` standard deviations (Box-Muller from a uniform u > 0 gives
|z| ≤ √(2·ln(1/u)) ≤ 37.7 even for the smallest positive double), which is what the fixed-point
range of the secure sum reserves for the noise rank 0 adds to it.

Streams: the round engine draws one tensor per summed field (each update group, the adaptive
statistic, the diagnostics) on stream ``"<run id>/<field>"`` (``engine/round.py``), so a field's
noise does not depend on the order or the number of the other fields.
"""

from __future__ import annotations

import abc
import hashlib
import math
from typing import Any

import numpy as np
import torch

from cluster_fl.privacy.csprng import ChaChaStream, draw_nonce, new_key

SECURE_DRAWS = 4  # 2n with n = 2, as Opacus' secure mode
TAIL_STDS = 64.0  # |noise| <= TAIL_STDS * std for every draw of either source (module docstring)


def stream_seed(seed: int, round_: int, stream: str) -> int:
    """63-bit generator seed derived from (seed, round, stream) by SHA-256."""
    digest = hashlib.sha256(f"cluster_fl/noise/{seed}/{round_}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _release_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a noised value is released in: the input's, never below float32."""
    return torch.promote_types(dtype, torch.float32)


class NoiseSource(abc.ABC):
    """Gaussian noise by (round, stream). Subclasses choose how a generator is seeded."""

    secure: bool = False

    @abc.abstractmethod
    def _standard(self, shape: tuple[int, ...], round_: int, stream: str,
                  device: torch.device) -> torch.Tensor:
        """float64 N(0, 1) samples of ``shape`` for (round, stream) on ``device``."""

    def gaussian(self, shape: tuple[int, ...] | torch.Size, std: float, *, round: int,
                 stream: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """N(0, std²) of ``shape`` in ``dtype`` promoted to ≥ float32 (generated in float64)."""
        if not std >= 0:
            raise ValueError(f"noise std must be >= 0, got {std}")
        device = torch.device(device)
        out_dtype = _release_dtype(dtype)
        if std == 0:
            return torch.zeros(shape, dtype=out_dtype, device=device)
        return (self._standard(tuple(shape), round, stream, device) * std).to(out_dtype)


class ResearchNoise(NoiseSource):
    """Deterministic noise from (seed, round, stream): reproducible, not secret."""

    secure = False

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def _standard(self, shape: tuple[int, ...], round_: int, stream: str,
                  device: torch.device) -> torch.Tensor:
        gen = torch.Generator(device=device)
        gen.manual_seed(stream_seed(self.seed, round_, stream))
        return torch.randn(shape, generator=gen, dtype=torch.float64, device=device)


class SecureNoise(NoiseSource):
    """Noise from a ChaCha20 keystream under a fresh 256-bit OS-CSPRNG key per draw, the
    sum-of-Gaussians construction; a seed is refused."""

    secure = True

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None:
            raise ValueError("secure-mode noise refuses a seed: it is drawn from the OS CSPRNG")

    def _standard(self, shape: tuple[int, ...], round_: int, stream: str,
                  device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        # a fresh key per draw: nothing links two draws, and (round, stream) name the nonce
        gen = ChaChaStream(new_key(), draw_nonce("noise", round_, stream))
        acc = np.zeros(n, dtype=np.float64)
        for _ in range(SECURE_DRAWS):
            acc += gen.normal(n)
        # Σ of k standard normals has variance k: scale by 1/√k
        acc *= 1.0 / math.sqrt(SECURE_DRAWS)
        return torch.from_numpy(acc).reshape(shape).to(device)


def make_noise(secure_mode: bool, seed: int | None = None) -> NoiseSource:
    """``SecureNoise()`` when ``secure_mode`` (any seed is refused), else ``ResearchNoise(seed)``."""
    if secure_mode:
        return SecureNoise(seed)
    if seed is None:
        raise ValueError("research-mode noise needs a seed (run.seed)")
    return ResearchNoise(seed)


def noise_for(privacy: Any, run_seed: int) -> NoiseSource:
    """The noise source of a run: secure (no seed passed) if ``privacy.secure_mode``, else
    research noise from ``run.seed``."""
    return make_noise(True) if privacy.secure_mode else make_noise(False, run_seed)

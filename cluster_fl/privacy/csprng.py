"""A cryptographic random stream for secure mode: Gaussian noise and cohort sampling.

Secure mode must not draw what protects clients from a generator whose state an observer could
reconstruct: a Mersenne Twister seeded with 63 bits, or a Philox keyed from a seed written in the
run folder. Here every draw reads the keystream of ChaCha20 (RFC 7539; a stream cipher, so its
output is indistinguishable from uniform without the key) under a 256-bit key from the OS CSPRNG
(``secrets``), in counter mode: the 96-bit nonce names the draw, the 32-bit block counter walks
through it, so one key serves many draws without ever reusing keystream.

* :class:`ChaChaStream` -- uint64 words, uniform floats on [0, 1) (53 bits), standard normals by
  Box-Muller on two independent 53-bit uniforms (the log of a uniform in (0, 1], so never of 0).
* :func:`sample_cohort_secure` -- the round's cohort under a key every rank shares (rank 0 draws
  it, the engine hands it on; the key is never written): Poisson (each client independently with
  q) or a uniform fixed-size subset (the m smallest of N random 64-bit keys).

Research mode keeps its reproducible streams (``privacy.noise.ResearchNoise``,
``engine.cohort.sample_cohort``); nothing here is seeded from ``run.seed``.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct

import numpy as np

KEY_BYTES = 32  # ChaCha20: 256-bit keys
_CHUNK = 1 << 20  # words per keystream chunk: peak memory stays flat for large draws
_TWO_PI = 2.0 * math.pi


def new_key() -> bytes:
    """A fresh 256-bit key from the OS CSPRNG."""
    return secrets.token_bytes(KEY_BYTES)


def draw_nonce(purpose: str, *keys: object) -> bytes:
    """A 96-bit nonce naming one draw: SHA-256 of ``purpose`` and ``keys``, truncated. Two
    distinct draws under one key must have distinct nonces (a collision at 96 bits is
    negligible for the draws a run makes)."""
    text = "/".join([purpose, *map(str, keys)]).encode()
    return hashlib.sha256(b"cluster_fl/csprng/v1/" + text).digest()[:12]


class ChaChaStream:
    """The ChaCha20 keystream of (``key``, ``nonce``) read as little-endian uint64 words.

    A keystream is 2^32 blocks of 64 bytes (256 GiB, 2^35 words) long; a draw past its end
    is refused rather than wrapped."""

    _LIMIT = (1 << 32) * 8  # words in one (key, nonce) keystream

    def __init__(self, key: bytes, nonce: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        if len(key) != KEY_BYTES or len(nonce) != 12:
            raise ValueError("ChaCha20 needs a 32-byte key and a 12-byte nonce")
        # cryptography's 16-byte ChaCha20 nonce = 4-byte block counter (from 0) + 12-byte nonce
        self._enc = Cipher(algorithms.ChaCha20(key, struct.pack("<I", 0) + nonce),
                           mode=None).encryptor()
        self._used = 0

    def uint64(self, n: int) -> np.ndarray:
        """The next ``n`` words of the keystream."""
        if n < 0 or self._used + n > self._LIMIT:
            raise ValueError(f"keystream exhausted: {self._used} + {n} words > {self._LIMIT}")
        out = np.empty(n, dtype=np.uint64)
        zeros = bytes(8 * min(_CHUNK, n))
        for start in range(0, n, _CHUNK):
            m = min(_CHUNK, n - start)
            out[start:start + m] = np.frombuffer(self._enc.update(zeros[:8 * m]), dtype="<u8")
        self._used += n
        return out

    def uniform(self, n: int) -> np.ndarray:
        """``n`` floats uniform on [0, 1): the top 53 bits of a word, times 2^-53 (exact)."""
        return (self.uint64(n) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def normal(self, n: int) -> np.ndarray:
        """``n`` standard normals (float64), Box-Muller on pairs of 53-bit uniforms; |z| is at
        most √(2·53·ln 2) ≈ 8.57 by construction (the smallest uniform in (0, 1] is 2^-53)."""
        pairs = (n + 1) // 2
        u1 = 1.0 - self.uniform(pairs)  # (0, 1]: the log is finite
        u2 = self.uniform(pairs)
        radius = np.sqrt(-2.0 * np.log(u1))
        z = np.concatenate([radius * np.cos(_TWO_PI * u2), radius * np.sin(_TWO_PI * u2)])
        return z[:n]


MAX_NORMAL = math.sqrt(2.0 * 53.0 * math.log(2.0))  # the largest |z| :meth:`ChaChaStream.normal` gives


def sample_cohort_secure(key: bytes, round_: int, population: int, clients_per_round: int,
                         sampling: str) -> list[int]:
    """Client indices (sorted) of ``round_``'s cohort, from the ChaCha20 stream of ``key``.

    ``poisson``: each client independently with q = min(1, clients_per_round / population)
    (u < q with u uniform on a 2^-53 grid: q is met to within 2^-53). ``fixed``: the
    min(m, N) clients with the smallest random 64-bit keys (ties broken by index, probability
    ≤ N²·2^-65): a uniform subset of that size."""
    if population < 1:
        raise ValueError("population must be >= 1")
    stream = ChaChaStream(key, draw_nonce("cohort", round_))
    if sampling == "poisson":
        q = min(1.0, clients_per_round / population)
        return np.flatnonzero(stream.uniform(population) < q).tolist()
    if sampling == "fixed":
        k = min(clients_per_round, population)
        words = stream.uint64(population)
        order = np.lexsort((np.arange(population), words))  # by word, then by index
        return sorted(order[:k].tolist())
    raise ValueError(f"unknown sampling {sampling!r}")

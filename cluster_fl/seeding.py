"""Derived seeds: every random choice in a run comes from (root seed, purpose, round, client).

Client training, cohort sampling and research-mode noise each take a seed derived here, so the
result of a round does not depend on which rank trained which client or on how many ranks ran.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed from the root seed and any hashable keys (stable across processes)."""
    text = "/".join([str(seed), *map(str, keys)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def generator(seed: int, *keys: object) -> torch.Generator:
    """A CPU torch generator seeded by :func:`derive_seed`."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *keys))
    return g

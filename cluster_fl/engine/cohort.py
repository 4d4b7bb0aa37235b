"""Who trains in a round, and on which rank.

The cohort is sampled from (seed, round) alone, and the blocks (clients trained together,
``fl.clients_per_step``, never fewer blocks than lanes while a block holds several clients) and
their assignment to lanes are pure functions of the cohort, the clients' data sizes and the number
of lanes, so every rank computes the same cohort, blocks and split without talking to the others
-- and a block trains the same on any rank, which keeps 1 vs N ranks bitwise equal wherever they
cut the same blocks (:func:`blocks`).
The aggregation denominator is public: the cohort size for fixed sampling and the expected size
q·N for Poisson sampling -- never the realised count.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cluster_fl.seeding import generator


def sampling_rate(clients_per_round: int, population: int) -> float:
    """q = expected cohort size / population (capped at 1)."""
    if population < 1:
        raise ValueError("population must be >= 1")
    return min(1.0, clients_per_round / population)


def sample_cohort(seed: int, round_: int, population: int, clients_per_round: int,
                  sampling: str) -> list[int]:
    """Client indices (sorted) that take part in ``round_``.

    ``poisson``: each client independently with q = clients_per_round / population.
    ``fixed``: exactly min(clients_per_round, population) clients without replacement.
    """
    g = generator(seed, "cohort", round_)
    if sampling == "poisson":
        q = sampling_rate(clients_per_round, population)
        picked = torch.rand(population, generator=g, dtype=torch.float64) < q
        return picked.nonzero().flatten().tolist()
    if sampling == "fixed":
        k = min(clients_per_round, population)
        return sorted(torch.randperm(population, generator=g)[:k].tolist())
    raise ValueError(f"unknown sampling {sampling!r}")


def denominator(clients_per_round: int, population: int, sampling: str) -> float:
    """The public divisor of the noised sum (independent of who was sampled)."""
    if sampling == "fixed":
        return float(min(clients_per_round, population))
    return sampling_rate(clients_per_round, population) * population


def shard(cohort: Sequence[int], sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Split ``cohort`` over ranks balancing total data size (greedy longest-first).

    Deterministic: ties broken by client index and then by rank. Returns one list per rank, each
    in increasing client order (the order does not change the exact secure sum anyway).
    """
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for client in sorted(cohort, key=lambda c: (-sizes[c], c)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(client)
        loads[rank] += max(1, sizes[client])
    return [sorted(s) for s in shards]


def blocks(cohort: Sequence[int], sizes: Sequence[int], per_block: int,
           lanes: int = 1) -> list[list[int]]:
    """The cohort as blocks of at most ``per_block`` clients trained in one batched step each.

    Clients are ordered by (data size, index) before they are cut, so a block's clients take
    similar numbers of local steps and pad to similar lengths (a client whose batches end early
    idles for the rest of its block). The ceil(n / per_block) blocks are as equal in size as
    possible (24 clients at 16 a block: two of 12, not 16 + 8, which would leave one of two lanes
    half idle). ``per_block`` = 1: one block a client.

    Blocks sized to the ``lanes``: never fewer blocks than min(n, lanes), so no lane idles while
    a block holds several clients (94 clients at 16 a block over 16 lanes: 16 blocks of ~6, not 6
    of ~16 and 10 idle lanes). The partition depends only on the number of blocks, so where the
    ceil(n / per_block) blocks already fill the lanes -- and always with ``per_block`` = 1 -- it is
    the same for any number of lanes, which keeps 1 and N ranks bitwise equal there; with fewer
    such blocks than lanes, N lanes train smaller blocks than one rank (within float tolerance of
    it, as any two block sizes are).
    """
    if per_block < 1 or lanes < 1:
        raise ValueError("per_block and lanes must be >= 1")
    order = sorted(cohort, key=lambda c: (sizes[c], c))
    n_blocks = max(-(-len(order) // per_block), min(lanes, len(order)))
    base, extra = divmod(len(order), max(1, n_blocks))
    out, start = [], 0
    for b in range(n_blocks):
        size = base + (1 if b < extra else 0)
        out.append(order[start:start + size])
        start += size
    return out


def shard_blocks(blocks_: Sequence[Sequence[int]], sizes: Sequence[int],
                 lanes: int) -> list[list[list[int]]]:
    """Split blocks over lanes balancing total data size, like :func:`shard` does clients.

    Blocks of one client give exactly :func:`shard`'s split. Each lane's blocks are in the order
    of their first client."""
    loads = [0] * lanes
    out: list[list[list[int]]] = [[] for _ in range(lanes)]
    weight = {tuple(b): sum(max(1, sizes[c]) for c in b) for b in blocks_}
    for b in sorted(blocks_, key=lambda b: (-sum(sizes[c] for c in b), min(b))):
        lane = min(range(lanes), key=lambda r: (loads[r], r))
        out[lane].append(list(b))
        loads[lane] += weight[tuple(b)]
    return [sorted(lane_blocks, key=min) for lane_blocks in out]

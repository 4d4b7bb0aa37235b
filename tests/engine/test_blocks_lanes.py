"""Blocks sized to the lanes: with L lanes, the cohort is never cut into fewer
blocks than lanes while a block holds several clients -- 94 clients at K = 16 over 16 lanes gave
6 blocks and 10 idle lanes. K is capped at ceil(cohort / L); where the K-blocks already occupy
every lane (and with K = 1) the blocks are exactly those of one rank, which keeps 1 vs N ranks
bitwise equal there (tests/engine/test_parity.py, test_batched.py hold that)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import FakeRunner, engine_config, make_engine, random_update

from cluster_fl.distributed.parallelize import LaneLayout
from cluster_fl.engine import cohort as cohort_mod


def _lanes(n: int, per_block: int, lanes: int, sizes=None) -> list[list[list[int]]]:
    sizes = sizes or [1 + (7 * c) % 5 for c in range(n)]
    return cohort_mod.shard_blocks(cohort_mod.blocks(list(range(n)), sizes, per_block, lanes),
                                   sizes, lanes)


def test_94_clients_at_16_a_block_keep_16_lanes_busy():
    lanes = _lanes(94, 16, 16)
    assert all(len(blocks) == 1 for blocks in lanes)
    assert sorted(len(blocks[0]) for blocks in lanes) == [5] * 2 + [6] * 14
    assert sorted(c for blocks in lanes for b in blocks for c in b) == list(range(94))
    # without the cap: 6 blocks of ~16, ten lanes idle
    old = cohort_mod.shard_blocks(cohort_mod.blocks(list(range(94)), [1] * 94, 16), [1] * 94, 16)
    assert sum(1 for blocks in old if not blocks) == 10


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 300), per_block=st.integers(1, 64), lanes=st.integers(1, 32))
def test_no_lane_idles_while_a_block_holds_several_clients(n, per_block, lanes):
    out = _lanes(n, per_block, lanes)
    idle = [i for i, blocks in enumerate(out) if not blocks]
    if idle:  # fewer clients than lanes: one client a block, each block its own lane
        assert all(len(b) == 1 for blocks in out for b in blocks)
        assert all(len(blocks) <= 1 for blocks in out)
    assert all(len(b) <= per_block for blocks in out for b in blocks)
    assert sorted(c for blocks in out for b in blocks for c in b) == list(range(n))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 300), per_block=st.integers(1, 64), lanes=st.integers(1, 32))
def test_blocks_equal_one_ranks_where_they_already_fill_the_lanes(n, per_block, lanes):
    sizes = [1 + (3 * c) % 7 for c in range(n)]
    one_rank = cohort_mod.blocks(list(range(n)), sizes, per_block)
    capped = cohort_mod.blocks(list(range(n)), sizes, per_block, lanes)
    if len(one_rank) >= lanes or per_block == 1:
        assert capped == one_rank
    else:  # exactly one block a lane, as equal as possible
        assert len(capped) == min(n, lanes)
        assert max(map(len, capped)) - min(map(len, capped)) <= 1


def test_the_round_engine_deals_capped_blocks_to_every_lane():
    cfg = engine_config("fl.clients_per_round=12", "fl.clients_per_step=8")
    per_lane = []
    for rank in range(4):
        engine = make_engine(cfg, FakeRunner(random_update), 12)
        engine.layout = LaneLayout(4, 1, rank)
        members, mine = engine.cohort(1)
        per_lane.append(mine)
    assert len(members) == 12
    assert [len(blocks) for blocks in per_lane] == [1, 1, 1, 1]
    assert all(len(blocks[0]) == 3 for blocks in per_lane)
    # one rank keeps K = 8: 12 clients in two blocks of 6
    engine = make_engine(cfg, FakeRunner(random_update), 12)
    assert [len(b) for b in engine.cohort(1)[1]] == [6, 6]

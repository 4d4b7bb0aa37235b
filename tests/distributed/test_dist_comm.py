"""Real gloo process groups through ``cluster_fl.distributed``: the collectives, the launcher helper's
error propagation, and collective timeouts (a dead or stuck rank fails its peers, no hang)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from cluster_fl.distributed import CommError, RankFailure, SpawnError, TorchComm, spawn

TIMEOUT_S = 5  # collective timeout used by the failure tests


def collectives(comm, payload):
    """Every Comm collective once; returns what this rank saw."""
    # int64 sums wrap mod 2^64 in the backend: the secure sum relies on it
    t = torch.tensor([2**63 - 1, comm.rank, -comm.rank], dtype=torch.int64)
    comm.all_reduce_sum(t)
    f = torch.full((3,), float(comm.rank))
    comm.broadcast(f, src=comm.world_size - 1)
    obj = comm.broadcast_object({"from": comm.rank, "payload": payload} if comm.rank == 1
                                else None, src=1)
    gathered = comm.all_gather_object((comm.rank, comm.local_rank))
    comm.barrier()
    return {"sum": t.tolist(), "bcast": f.tolist(), "obj": obj, "gathered": gathered,
            "is_main": comm.is_main, "world": comm.world_size, "real": isinstance(comm, TorchComm)}


def test_collectives_on_three_gloo_ranks_agree_and_int64_sums_wrap():
    out = spawn(collectives, 3, [1, 2.5, "x"], timeout_s=60)
    wrapped = (3 * (2**63 - 1)) % 2**64
    wrapped -= 2**64 if wrapped >= 2**63 else 0
    for rank, r in enumerate(out):
        assert r["real"] and r["world"] == 3 and r["is_main"] == (rank == 0)
        assert r["sum"] == [wrapped, 3, -3]
        assert r["bcast"] == [2.0, 2.0, 2.0]
        assert r["obj"] == {"from": 1, "payload": [1, 2.5, "x"]}
        assert r["gathered"] == [(0, 0), (1, 1), (2, 2)]


def failing(comm):
    raise ValueError("boom from the child")


def test_spawn_fails_the_parent_with_the_child_traceback():
    with pytest.raises(SpawnError, match=r"(?s)rank 0 of 1 failed.*ValueError: boom from"):
        spawn(failing, 1, use_fake=True, timeout_s=60)


def dead_peer(comm, how):
    """Rank 1 leaves (raises, or stalls past the timeout); rank 0 tries to all-reduce."""
    if comm.rank == 1:
        if how == "raise":
            raise RuntimeError("rank 1 dies before the collective")
        time.sleep(TIMEOUT_S + 3.0)
        os._exit(0)  # never reaches a collective
    start = time.monotonic()
    try:
        comm.all_reduce_sum(torch.ones(4, dtype=torch.int64))
    except CommError as exc:
        return {"elapsed": time.monotonic() - start, "error": str(exc)}
    return {"elapsed": time.monotonic() - start, "error": None}


@pytest.mark.parametrize("how", ["raise", "stall"])
def test_a_dead_or_stuck_rank_fails_its_peer_within_the_timeout(how):
    t0 = time.monotonic()
    out = spawn(dead_peer, 2, how, timeout_s=60, comm_timeout_s=TIMEOUT_S, raise_on_error=False)
    assert isinstance(out[1], RankFailure)
    if how == "raise":  # the dead child's traceback comes back to the parent
        assert "rank 1 dies before the collective" in out[1].error
    r0 = out[0]
    assert not isinstance(r0, RankFailure), r0
    assert r0["error"] is not None and "within 5 s" in r0["error"]
    # a process that exits closes its sockets: the peer fails at once; a stuck one is timed out
    assert r0["elapsed"] <= TIMEOUT_S + 3.0
    if how == "stall":
        assert r0["elapsed"] >= TIMEOUT_S - 1.0
    assert time.monotonic() - t0 < 45


def killed_in_slow_wait(comm):
    """Rank 1 dies at once; rank 0 waits in a ``slow`` all-reduce whose limit is 120 s."""
    if comm.rank == 1:
        time.sleep(1.0)
        os._exit(1)
    start = time.monotonic()
    try:
        comm.all_reduce_sum(torch.ones(4, dtype=torch.int64), slow=True)
    except CommError as exc:
        return {"elapsed": time.monotonic() - start, "error": str(exc)}
    return {"elapsed": time.monotonic() - start, "error": None}


def test_a_killed_rank_fails_a_slow_wait_within_the_dead_peer_timeout():
    # the long limit is for live-but-slow ranks; a dead one closes its sockets and is seen at once
    out = spawn(killed_in_slow_wait, 2, timeout_s=60, comm_timeout_s=TIMEOUT_S, wait_timeout_s=120,
                raise_on_error=False)
    assert isinstance(out[1], RankFailure)
    r0 = out[0]
    assert not isinstance(r0, RankFailure), r0
    assert r0["error"] is not None and "within 120 s" in r0["error"]
    assert r0["elapsed"] <= TIMEOUT_S + 3.0

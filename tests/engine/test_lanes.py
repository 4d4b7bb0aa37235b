"""Client lanes (``model.shard_group_size`` G > 1, FSDP2 over gloo) against unsharded runs.

A lane of G ranks trains one client at a time with the frozen base sharded over its members;
each member runs a slice of every batch and the lane sums the trainable gradients. The released
sum, every client's clip decision and ε must equal those of an unsharded run of the same clients
(training itself within float tolerance: the lane's gradient is a sum of per-slice sums in
another order). Flat clipping at C = 0.41, just above the typical first-round update norm of the
tiny model, so that some clients are clipped and some are not.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import (cohort_sizes, decisions_worker, slow_rank_worker, tiny_config,
                            tiny_overrides)

from cluster_fl.distributed import RankFailure, spawn

LANE = ["model.shard=fsdp2", "model.shard_group_size=2"]
MIXED_CLIPPING = ["privacy.clipping=flat", "privacy.clip_norm=0.41"]
REL_TOL = 1e-5


def _initial_state(cfg) -> dict[str, torch.Tensor]:
    from cluster_fl.models import build_model, get_trainable
    from cluster_fl.seeding import derive_seed

    torch.manual_seed(derive_seed(cfg.run.seed, "init"))
    return get_trainable(build_model(cfg.model))


def _delta(state, init) -> torch.Tensor:
    return torch.cat([(state[k].double() - init[k].double()).reshape(-1) for k in sorted(init)])


def _decisions(results) -> dict:
    merged: dict = {}
    for r in results:
        if isinstance(r, dict):
            merged.update(r.get("decisions", {}))
    return merged


def _assert_same_run(plain, lanes, init):
    a, b = _decisions(plain), _decisions(lanes)
    assert a.keys() == b.keys() and len(a) >= 8  # every client of both rounds, once
    assert [v[:2] for k, v in sorted(a.items())] == [v[:2] for k, v in sorted(b.items())]
    flags = [v[0] for v in a.values()]
    assert any(flags) and not all(flags), "the test needs clipped and unclipped clients"
    for key in a:
        assert math.isclose(a[key][2], b[key][2], rel_tol=REL_TOL), key
    da, db = _delta(plain[0]["state"], init), _delta(lanes[0]["state"], init)
    assert float((da - db).norm() / da.norm()) <= REL_TOL
    eps_a = [r["epsilon"] for r in plain[0]["rows"]]
    assert eps_a == [r["epsilon"] for r in lanes[0]["rows"]] and all(map(math.isfinite, eps_a))
    assert cohort_sizes(plain[0]["folder"]) == cohort_sizes(lanes[0]["folder"])
    for ra, rb in zip(plain[0]["rows"], lanes[0]["rows"]):
        assert ra["clip_rate"] == rb["clip_rate"]
    for v in lanes[0]["state"].values():
        assert v.dtype == torch.float32


@pytest.fixture(scope="module")
def overrides(tiny_corpus, reference_run, tmp_path_factory):
    # reference_run fills the shared feature cache first, so concurrent ranks only read it;
    # float32: REL_TOL is float32's (a bf16 base rounds each side's sums its own way)
    return lambda name, *extra: tiny_overrides(tiny_corpus, tmp_path_factory.mktemp(name),
                                               *MIXED_CLIPPING, "model.dtype=float32", *extra)


@pytest.fixture(scope="module")
def plain_one_rank(overrides):
    return spawn(decisions_worker, 1, overrides("plain1"), use_fake=True, timeout_s=200)


def test_fsdp2_lane_of_two_matches_one_unsharded_rank(plain_one_rank, overrides, tiny_corpus,
                                                      tmp_path):
    lanes = spawn(decisions_worker, 2, overrides("lane2", *LANE), timeout_s=200)
    _assert_same_run(plain_one_rank, lanes, _initial_state(tiny_config(tiny_corpus, tmp_path)))


@pytest.fixture(scope="module")
def plain_two_ranks(overrides):
    return spawn(decisions_worker, 2, overrides("plain2"), timeout_s=240)


# four ranks (~45 s): `slow`, run by .ci/run after the default suite; the lane of two above is
# the default suite's lane parity check
@pytest.mark.slow
@pytest.mark.parametrize("shard", ["fsdp2"])
def test_two_lanes_of_two_match_two_unsharded_ranks(plain_two_ranks, overrides, tiny_corpus,
                                                    tmp_path, shard):
    lanes = spawn(decisions_worker, 4, overrides(f"lanes4-{shard}", f"model.shard={shard}",
                                                 "model.shard_group_size=2"), timeout_s=300)
    _assert_same_run(plain_two_ranks, lanes, _initial_state(tiny_config(tiny_corpus, tmp_path)))


def test_a_world_that_g_does_not_divide_is_refused(overrides):
    out = spawn(decisions_worker, 2, overrides("bad", "model.shard=fsdp2",
                                                "model.shard_group_size=4"),
                timeout_s=120, raise_on_error=False)
    assert all(isinstance(r, RankFailure) for r in out)
    assert "does not divide the world size 2" in out[0].error


@pytest.mark.slow  # ~20 s; the long wait at load: test_startup.py's rank that loads 5 s late
def test_a_rank_slower_than_the_dead_peer_timeout_does_not_fail_the_round(overrides):
    # the dead-peer limit is 3 s; rank 1 starts its first client 8 s late, so rank 0 waits
    # about 8 s in the secure sum's all-reduce: that wait has the long limit (run.wait_timeout_s)
    out = spawn(slow_rank_worker, 2, overrides("slow", "run.timeout_s=3", "fl.rounds=1"), 8.0,
                timeout_s=200, comm_timeout_s=3, wait_timeout_s=120, raise_on_error=False)
    assert all(isinstance(r, dict) for r in out), out
    assert out[0]["round"] == 1

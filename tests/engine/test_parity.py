"""1 process vs 2 gloo ranks: a real ``run_training`` gives the same model and metrics, bit for bit.

The tiny speech-LLM (random init, no checkpoint) trains 2 DP rounds on the session's tiny corpus,
once in one process (the ``LocalComm`` fake) and once over two real gloo ranks that split each
cohort. Because each client's randomness comes from (seed, round, client) and the secure sum is
exact, the final trainable state (read from the run folder's checkpoint) and every round row
(except wall time) must be identical to the last bit. Equality alone would also hold if no
client's update reached the sum on either side (both would release the same noise): a third run
with every update zeroed before clipping releases that noise alone, and the trained state must
differ from it by what the clipped updates can move it.

Preemption under several ranks: on a cluster the ranks' signals are not synchronised (one rank can
see SIGTERM a round earlier than another), so the ranks must agree on "stop now" collectively
before checkpointing and raising ``Preempted``; otherwise the signalled rank exits while its peers
enter the next round's all-reduce and fail with a communication error instead of exit code 75.
"""

from __future__ import annotations

import pytest

from engine_helpers import (cohort_sizes, noise_only_worker, preempt_rank0_worker,
                            tiny_overrides, training_worker)

from cluster_fl.distributed import bitwise_differences, spawn


@pytest.fixture(scope="module")
def parity_runs(tiny_corpus, reference_run, tmp_path_factory):
    # the single-process reference runs first: it fills the shared feature cache, so the two
    # ranks only read it
    out = tmp_path_factory.mktemp("parity")
    two = spawn(training_worker, 2, tiny_overrides(tiny_corpus, out), timeout_s=150)
    return [reference_run], two


def test_two_ranks_train_the_same_model_as_one_process_bit_for_bit(parity_runs):
    one, two = parity_runs
    assert one[0]["round"] == two[0]["round"] == 2
    assert one[0]["state"], "empty trainable state"
    assert bitwise_differences(one[0]["state"], two[0]["state"]) == []


def test_training_moved_the_state_beyond_the_shared_noise(parity_runs, tiny_corpus,
                                                        tmp_path_factory):
    import math

    from cluster_fl.config import load_config

    one, two = parity_runs
    overrides = tiny_overrides(tiny_corpus, tmp_path_factory.mktemp("noise_only"))
    noise = spawn(noise_only_worker, 1, overrides, use_fake=True, timeout_s=150)[0]
    cfg = load_config(None, overrides)
    trained = {k: v.double() for k, v in two[0]["state"].items()}
    moved = math.sqrt(sum(float((trained[k] - v.double()).pow(2).sum())
                          for k, v in noise["state"].items()))
    # the server step is linear in the released mean (momentum β): what the clients contributed
    # is at most rounds·(1+β)·C·|cohort|/n; a run whose updates never reached the sum moves 0
    bound = 2 * (1 + cfg.aggregation.server_momentum) * cfg.privacy.clip_norm * 9 / 4
    assert 1e-3 < moved <= bound, moved


def test_two_ranks_record_the_same_round_metrics_as_one_process(parity_runs):
    one, two = parity_runs
    rows1, rows2 = one[0]["rows"], two[0]["rows"]
    assert [r["round"] for r in rows1] == [1, 2]
    # the cohort really was split: more than one client per round, all trained
    assert all(n >= 2 for n in cohort_sizes(one[0]["folder"]))
    assert bitwise_differences(rows1, rows2) == []


def test_a_signal_on_rank_0_only_preempts_both_ranks_after_the_same_round(tiny_corpus,
                                                                          reference_run,
                                                                          tmp_path):
    # (reference_run only makes sure the feature cache is filled before two ranks read it)
    overrides = tiny_overrides(tiny_corpus, tmp_path, "fl.rounds=3")
    results = spawn(preempt_rank0_worker, 2, overrides, 1, timeout_s=150, comm_timeout_s=15,
                    raise_on_error=False)
    ends = [getattr(r, "error", None) or r for r in results]
    assert all(isinstance(r, dict) for r in results), ends
    assert [r["end"] for r in results] == ["preempted", "preempted"], ends
    assert results[0]["checkpoint_round"] == 1


def test_evaluation_sharded_over_two_ranks_equals_the_one_rank_evaluation(parity_runs):
    # each rank decoded only its batches; rank 0 gathered and scored them: same rows, same WER
    import pyarrow.parquet as pq
    from pathlib import Path

    one, two = parity_runs
    rows1 = pq.read_table(Path(one[0]["folder"]) / "eval.parquet").to_pylist()
    rows2 = pq.read_table(Path(two[0]["folder"]) / "eval.parquet").to_pylist()
    assert len(rows1) == 4 and rows1 == rows2
    final1 = pq.read_table(Path(one[0]["folder"]) / "final.parquet").to_pylist()[0]
    final2 = pq.read_table(Path(two[0]["folder"]) / "final.parquet").to_pylist()[0]
    for key in [k for k in final1 if k.startswith(("wer", "cer"))]:
        assert final1[key] == final2[key], key

"""Sharded evaluation: lanes decode disjoint batches planned from metadata alone."""

from __future__ import annotations

from dataclasses import dataclass

from cluster_fl.distributed.parallelize import LaneLayout
from cluster_fl.engine.evaluation import ShardedEvaluation, evaluation_line, plan_batches


@dataclass
class Utt:
    utterance_id: str
    transcript: str
    duration: float | None
    shard: str = "s"


def _utts(n: int) -> list[Utt]:
    return [Utt(f"u{i}", "x" * (i % 5), None if i % 7 == 0 else (i * 37 % 11) / 3) for i in range(n)]


def test_batches_cover_every_utterance_once_shortest_first():
    utts = _utts(23)
    batches = plan_batches(utts, 4)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(23)) and [len(b) for b in batches] == [4] * 5 + [3]
    keys = [(utts[i].duration or 0.0, len(utts[i].transcript)) for i in flat]
    assert keys == sorted(keys)


def test_lanes_take_disjoint_batches_that_together_are_the_one_lane_plan():
    utts = _utts(23)
    plan = [ShardedEvaluation(None, utts, LaneLayout(6, 2, r), 4, 8, 0, 0).my_batches()
            for r in range(6)]
    assert plan[0] == plan[1] and plan[2] == plan[3]  # members of a lane decode the same batches
    lanes = plan[0::2]
    one = ShardedEvaluation(None, utts, LaneLayout(1, 1, 0), 4, 8, 0, 0).my_batches()
    assert sorted(b for lane in lanes for b in lane) == sorted(one)
    assert sum(map(len, lanes)) == len(one)


def test_a_mid_run_evaluation_logs_a_readable_wer_line():
    from cluster_fl.engine.evaluation import evaluation_line

    summary = {"wer": 0.91234, "wer_ci_low": 0.875, "wer_ci_high": 0.9612, "n_utterances": 240}
    assert evaluation_line(3, 12, summary) == "round 3/12: test WER 0.912 [0.875, 0.961] (240 utterances)"
    # without a bootstrap (eval.bootstrap: 0) the CI is NaN and left out
    summary.update(wer_ci_low=float("nan"), wer_ci_high=float("nan"))
    assert evaluation_line(3, 12, summary) == "round 3/12: test WER 0.912 (240 utterances)"


class _GatherComm:
    """Rank 0 of a world whose lanes hand back ``parts`` (in rank order) from the gather."""

    rank = 0

    def __init__(self, parts):
        self.parts = parts

    def all_gather_object(self, obj, slow=False):
        return [obj] + self.parts[1:]


def _row(i: int) -> dict:
    return {"utt_id": f"u{i}", "speaker": f"s{i % 3}", "language": "en", "ref": "a b", "hyp": "a",
            "word_errors": i % 2, "ref_words": 2, "char_errors": 0, "ref_chars": 3}


def test_rank_0_puts_the_gathered_rows_back_in_the_evaluation_sets_order(monkeypatch):
    # lanes decode their batches shortest first, so their rows arrive out of set order and
    # interleaved; rank 0 sorts them by position in the set (a 1-rank vs 2-rank comparison alone
    # cannot see a wrong order: both sides would carry it)
    ev = ShardedEvaluation(None, _utts(10), LaneLayout(1, 1, 0), 4, 8, 0, 0)
    mine = [(i, {**_row(i), "cut": i == 9}) for i in (7, 2, 9)]
    other = [(i, {**_row(i), "cut": i in (0, 3)}) for i in (5, 0, 3, 1)]
    monkeypatch.setattr(ev, "decode", lambda model, placement: mine)
    ev.budget = 8
    summary, rows = ev.run(None, None, _GatherComm([None, other]))
    assert [r["utt_id"] for r in rows] == [f"u{i}" for i in (0, 1, 2, 3, 5, 7, 9)]
    assert summary["n_utterances"] == 7
    # hypotheses cut by eval.max_new_tokens: counted beside the WER, not an eval.parquet column
    assert summary["hypotheses_cut"] == 3 and summary["max_new_tokens"] == 8
    assert all("cut" not in r for r in rows)
    assert evaluation_line(1, 2, summary).endswith("(7 utterances, 3 cut at 8 tokens)")


def test_a_runs_evaluation_decodes_with_its_configured_cache(tiny_corpus, tmp_path,
                                                             monkeypatch):
    import importlib

    import torch

    from engine_helpers import tiny_config

    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine import setup

    ev = importlib.import_module("cluster_fl.eval.evaluate")  # the module, not its function
    torch.set_num_threads(1)
    real, caches = ev.greedy_decode, []

    def spy(model, batch, n, cache, cut=None):
        caches.append(cache)
        return real(model, batch, n, cache=cache, cut=cut)
    monkeypatch.setattr(ev, "greedy_decode", spy)
    cfg = tiny_config(tiny_corpus, tmp_path, "eval.max_utterances=2", "eval.decode_cache=dynamic")
    world = setup.build_world(cfg, LocalComm(), lambda m: None)
    summary, rows = world.evaluate(world.initial_state)
    assert len(rows) == 2 and caches == ["dynamic", "dynamic"]  # eval.batch_size=1


def test_a_lane_holds_one_chunk_of_features_at_a_time_and_decodes_the_same(monkeypatch):
    import cluster_fl.engine.evaluation as evaluation
    import cluster_fl.eval as eval_pkg

    utts = _utts(10)
    loads: list[int] = []

    def fake_load(store, group):
        loads.append(len(group))
        return {u.utterance_id: {"features": None, "u": u} for u in group}

    monkeypatch.setattr(evaluation, "load_examples", fake_load)
    monkeypatch.setattr(eval_pkg, "transcribe", lambda model, items, **k: (
        k["cut"].extend([False] * len(items)) or [it["u"].transcript for it in items]))
    monkeypatch.setattr(eval_pkg, "score_rows", lambda items, hyps: [
        {"utt_id": it["u"].utterance_id, "hyp": h} for it, h in zip(items, hyps)])

    class Placement:
        def compute(self):
            import contextlib
            return contextlib.nullcontext()

    whole = ShardedEvaluation(None, utts, LaneLayout(1, 1, 0), 2, 8, 0, 0).decode(None,
                                                                                   Placement())
    assert loads == [10]
    loads.clear()
    monkeypatch.setattr(evaluation, "LOADED_UTTERANCES", 4)  # two batches of 2 a chunk
    chunked = ShardedEvaluation(None, utts, LaneLayout(1, 1, 0), 2, 8, 0, 0).decode(None,
                                                                                     Placement())
    assert loads == [4, 4, 2] and chunked == whole

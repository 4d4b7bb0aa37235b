"""Evaluation sharded across client lanes: each lane decodes and loads only its slice.

The evaluation set is planned from metadata alone (no features loaded): utterances sorted by
(duration, transcript length, id) and cut into batches of ``eval.batch_size``. Batches, not
utterances, are dealt to lanes (batch b to lane b mod L), so every batch holds the same
utterances whatever the number of ranks -- and decoding a batch is a deterministic function of
its utterances, so the rows equal a 1-rank evaluation's exactly. A lane loads the features of
its batches a chunk at a time (``LOADED_UTTERANCES``; never the whole split), decodes them, and
its leader's rows are gathered on rank 0 (a ``slow`` collective: it waits for the slowest
lane), which puts them back in the evaluation set's order and scores them.
"""

from __future__ import annotations

from typing import Any, Sequence

from cluster_fl.distributed import Comm
from cluster_fl.distributed.parallelize import LaneLayout, Placement
from cluster_fl.progress import progress


# a lane holds the features of at most this many evaluation utterances at once (~1 GiB of
# 15 s, 128-bin utterances): the whole MLS test set (19,492) would be ~11 GB a lane
LOADED_UTTERANCES = 2048


def plan_batches(utterances: Sequence[Any], batch_size: int) -> list[list[int]]:
    """Indices into ``utterances`` grouped into decoding batches (shortest first)."""
    order = sorted(range(len(utterances)), key=lambda i: (
        utterances[i].duration or 0.0, len(utterances[i].transcript), utterances[i].utterance_id))
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


def load_examples(store: Any, utterances: Sequence[Any]) -> dict[str, Any]:
    """utterance id -> example for ``utterances``, one corpus shard in memory at a time."""
    by_shard: dict[str, list[Any]] = {}
    for u in utterances:
        by_shard.setdefault(u.shard, []).append(u)
    out: dict[str, Any] = {}
    for group in by_shard.values():
        for ex in store.examples(group):
            out[ex.utterance_id] = ex
        store.release()  # drop the shard's other utterances (each feature is its own tensor)
    return out


class ShardedEvaluation:
    """The run's evaluation set (metadata) and how this rank takes part in decoding it."""

    def __init__(self, store: Any, utterances: Sequence[Any], layout: LaneLayout,
                 batch_size: int, max_new_tokens: int | str, bootstrap: int, seed: int, *,
                 decode_cache: str = "auto"):
        self.store, self.utterances, self.layout = store, list(utterances), layout
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens  # an int or "auto"
        self.budget = 0  # the limit decoded to: eval.max_new_tokens, or auto's (decode_budget)
        self.decode_cache = decode_cache  # eval.decode_cache: speed only, the same rows
        self.bootstrap, self.seed = bootstrap, seed

    def my_batches(self) -> list[list[int]]:
        """This lane's batches (every member of a lane decodes the same ones)."""
        batches = plan_batches(self.utterances, self.batch_size)
        return batches[self.layout.lane::self.layout.lanes]

    def decode(self, model: Any, placement: Placement) -> list[tuple[int, dict]]:
        """(index, row) for every utterance of this lane's batches that has features."""
        from cluster_fl.eval import decode_budget, score_rows, transcribe

        mnt = self.max_new_tokens
        self.budget = int(mnt) if mnt != "auto" else decode_budget(
            "auto", model.tokenizer, [u.transcript for u in self.utterances])
        batches = self.my_batches()
        out: list[tuple[int, dict]] = []
        shown = self.layout.lane == 0 and self.layout.leader  # one bar: rank 0's
        examples: dict[str, Any] = {}
        per_chunk = max(1, LOADED_UTTERANCES // self.batch_size)
        for b, batch in enumerate(progress(batches, desc="decoding", unit="batch", enabled=shown)):
            if b % per_chunk == 0:  # the next chunk's features; the last chunk's let go
                examples = load_examples(self.store, [self.utterances[i] for c in
                                                      batches[b:b + per_chunk] for i in c])
            idx = [i for i in batch if self.utterances[i].utterance_id in examples]
            items = [examples[self.utterances[i].utterance_id] for i in idx]
            if not items:
                continue
            cut: list[bool] = []
            with placement.compute():
                hyps = transcribe(model, items, batch_size=len(items),
                                  max_new_tokens=self.budget,
                                  decode_cache=self.decode_cache, show=False, cut=cut)
            rows = score_rows(items, hyps)
            for row, c in zip(rows, cut):
                row["cut"] = c  # counted on rank 0, not an eval.parquet column
            out.extend(zip(idx, rows))
        return out

    def run(self, model: Any, placement: Placement, comm: Comm
            ) -> tuple[dict | None, list[dict] | None]:
        """Collective: every rank calls it. Rank 0 gets (summary, rows in set order); the other
        ranks get (None, None)."""
        from cluster_fl.eval.metrics import summarize

        mine = self.decode(model, placement) if len(self.utterances) else []
        gathered = comm.all_gather_object(mine if self.layout.leader else [], slow=True)
        if comm.rank != 0:
            return None, None
        rows = [row for _, row in sorted((pair for part in gathered for pair in part),
                                         key=lambda pair: pair[0])]
        cut = sum(bool(row.pop("cut", False)) for row in rows)
        return {**summarize(rows, bootstrap=self.bootstrap, seed=self.seed),
                "hypotheses_cut": cut, "max_new_tokens": self.budget}, rows


def wer_text(summary: dict[str, Any]) -> str:
    """``test WER 0.912 [0.875, 0.961] (240 utterances)``: a mid-run evaluation (``eval.every``)
    of the released model with its speaker-bootstrap 95% CI -- public test speakers scoring a
    released model, so it is post-processing of the release, something a reader can follow while
    the noised per-round diagnostics of a small cohort are too noisy to show."""
    low, high = summary.get("wer_ci_low"), summary.get("wer_ci_high")
    ci = (f" [{low:.3f}, {high:.3f}]"
          if isinstance(low, float) and isinstance(high, float) and low == low and high == high
          else "")
    return (f"test WER {summary['wer']:.3f}{ci} "
            f"({int(summary.get('n_utterances', 0))} utterances{cut_note(summary)})")


def evaluation_line(r: int, rounds: int, summary: dict[str, Any]) -> str:
    """The test WER of round ``r`` alone (the round line carries it with the rest)."""
    return f"round {r}/{rounds}: {wer_text(summary)}"


def cut_note(summary: dict[str, Any]) -> str:
    """``, N cut at T tokens`` when hypotheses hit ``eval.max_new_tokens`` (their WER is
    inflated by the cut, not by the model), else nothing."""
    n = int(summary.get("hypotheses_cut") or 0)
    return f", {n} cut at {summary.get('max_new_tokens')} tokens" if n else ""

"""What the data could not give is said, not swallowed.

- a requested language that the corpus lacks is a one-line error naming it and the opt-out key;
  with ``data.allow_missing_languages=true`` the run uses the languages present and logs the rest;
- a corpus row whose audio does not decode is logged and counted per client for the operator
  (``.operator/<run_id>.skipped.json`` and the operator log, outside the run folder: an exact
  per-client count is no release of a DP run), also when a later run reads the shard's features
  from the cache; the run folder names neither the row nor a count.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine_helpers import tiny_config

from cluster_fl.engine.setup import load_clients
from cluster_fl.errors import UserError
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)


def test_a_language_the_corpus_lacks_is_an_error_unless_the_user_opts_out(tiny_corpus):
    cfg = resolved_config(None, [f"data.corpus={tiny_corpus}", "data.languages=[en,sv]"])
    with pytest.raises(UserError) as exc:
        load_clients(cfg)
    msg = str(exc.value)
    assert "data.languages" in msg and "sv" in msg and "data.allow_missing_languages" in msg
    logged: list[str] = []
    cfg = resolved_config(None, [f"data.corpus={tiny_corpus}", "data.languages=[en,sv]",
                             "data.allow_missing_languages=true"])
    _, clients, eval_utts = load_clients(cfg, logged.append)
    assert clients and {c.language for c in clients} == {"en"}
    assert {u.language for u in eval_utts} == {"en"}
    assert len(logged) == 1 and "sv" in logged[0]


def _corrupt_row(shard, row):
    table = pq.read_table(shard)
    audio = table.column("audio").to_pylist()
    audio[row] = {"bytes": b"not audio", "path": "bad.flac"}
    table = table.set_column(table.schema.get_field_index("audio"), "audio",
                             pa.array(audio, type=table.schema.field("audio").type))
    pq.write_table(table, shard)
    return table.column("utterance_id")[row].as_py(), table.column("speaker")[row].as_py()


def test_an_undecodable_row_is_counted_per_client_for_the_operator_only(tiny_corpus, tmp_path):
    from cluster_fl.engine.operator_log import operator_path, read_operator_log
    from cluster_fl.engine.train import run_training

    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, corpus, ignore=shutil.ignore_patterns("features"))
    bad, speaker = _corrupt_row(corpus / "de" / "private" / "part-00000.parquet", 1)
    torch.set_num_threads(1)
    # every client trains once, so the damaged shard is read
    extra = ["fl.rounds=1", "fl.sampling=fixed", "fl.clients_per_round=9", "eval.max_utterances=2"]
    for attempt in ("computed", "cached"):  # the second run reads the features from the cache
        cfg = tiny_config(corpus, tmp_path / attempt, *extra)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            folder = run_training(cfg)
        # a private run: the row's id goes to the operator log, not to stderr
        assert not [str(w.message) for w in seen if bad in str(w.message)]
        skipped = json.loads(operator_path(folder, ".skipped.json").read_text())
        assert skipped["skipped"] == 1
        assert skipped["per_client"] == {f"de/{speaker}": 1}
        assert skipped["rows"][0]["utterance_id"] == bad and skipped["rows"][0]["reason"]
        events = read_operator_log(folder)
        assert any(f"skipped unusable corpus row {bad}" in e.get("message", "") for e in events)
        assert [e["skipped_utterances"] for e in events if e["event"] == "done"] == [1]
        final = pq.read_table(folder / "final.parquet").to_pylist()[0]
        assert not {"skipped_utterances", "empty_rounds", "wall_s"} & set(final)
        assert not (folder / "skipped.json").exists()
        for path in folder.rglob("*"):  # neither the row nor its speaker's count is released
            if path.is_file() and path.suffix in (".txt", ".json", ".yaml"):
                assert bad not in path.read_text(), path


def test_batches_group_utterances_of_similar_length_and_keep_every_utterance(tiny_corpus):
    # make_batches: shuffle, order by 16-frame length bin, cut, shuffle the batches -- each
    # utterance once per pass, as many batches as an unsorted pass, reproducible from the
    # generator, and a batch's lengths span little more than a bin when the client has enough
    import torch

    from cluster_fl.engine.setup import LENGTH_BIN, load_clients, make_batches
    from engine_helpers import tiny_config

    cfg = tiny_config(tiny_corpus, tiny_corpus.parent / "unused")
    _, clients, _ = load_clients(cfg)
    items = [e for c in clients for e in c.load()]
    lengths = sorted(e.features.shape[-1] for e in items)

    def one_pass(seed):
        return list(make_batches(items, 4, torch.Generator().manual_seed(seed)))

    batches = one_pass(0)
    assert len(batches) == -(-len(items) // 4)
    assert sorted(x for b in batches for x in b["lengths"].tolist()) == lengths
    assert [b["texts"] for b in one_pass(0)] == [b["texts"] for b in batches]
    assert [b["texts"] for b in one_pass(1)] != [b["texts"] for b in batches]
    # sorted into bins before cutting: a batch's rows never straddle more than the bins between
    # two consecutive sorted cut points (a random batch spans most of the length range)
    spans = [max(b["lengths"]) // LENGTH_BIN - min(b["lengths"]) // LENGTH_BIN for b in batches]
    assert sum(spans) < sum((lengths[-1] - lengths[0]) // LENGTH_BIN for _ in batches) / 2

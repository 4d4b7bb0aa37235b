"""Truncated files: a checkpoint, a corpus shard, a run's config.yaml, a results file under
``table``, a feature-cache file. Each ends in one line naming the file (exit 2, status ``failed``)
or, where the run can go on (a cache file), in the identical result.

Restarting from round 1 after deleting a damaged checkpoint keeps the run's write-ahead privacy
ledger: the rounds it had released stay charged. In research mode the rerun reproduces them bit
for bit, so T stays the rounds run and the result is the uninterrupted one -- except that the
rows of the rounds run again report the ε already spent (the conservative figure), not the ε the
first attempt had spent by then.
"""

from __future__ import annotations

import json
import os
import shutil

from reliability_helpers import (assert_identical, config_file, folder_of, one_line_error,
                                 result, status, train_in_process)

from cluster_fl.cli import main


def _truncate(path, keep: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


def _unfinished_copy(reference, tiny_corpus, out, round_=2):
    """The reference run's folder copied under ``out`` and set back to 'running' after a round,
    as a run killed there would be (its checkpoint, though, is the last round's)."""
    folder = folder_of(tiny_corpus, out)
    shutil.copytree(reference["folder"], folder)
    st = status(folder)
    st.update(state="running", round=round_)
    (folder / "status.json").write_text(json.dumps(st))
    (folder / "final.parquet").unlink()
    return folder


def test_a_truncated_checkpoint_is_one_line_then_deleting_it_reruns_identically(
        tiny_corpus, tmp_path, reference, capsys):
    folder = _unfinished_copy(reference, tiny_corpus, tmp_path)
    ckpt = folder / "checkpoint" / "state.pt"
    _truncate(ckpt)
    config = config_file(tiny_corpus, tmp_path)
    assert main(["train", str(config)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(ckpt) in line and "unreadable" in line, line
    st = status(folder)
    assert st["state"] == "failed" and str(ckpt) in st["error"]
    shutil.rmtree(ckpt.parent)  # what the message says to do
    train_in_process(tiny_corpus, tmp_path)
    assert_identical(folder, reference, rows_ignore=("epsilon",))
    spent = json.loads((folder / "privacy.json").read_text())
    assert spent["rounds"] == 3 and spent["epsilon"] == reference["privacy"]["epsilon"]
    rows = [r["epsilon"] for r in result(folder)["rounds"]]
    assert rows == [spent["epsilon"]] * 3  # already spent before the restart


def test_a_truncated_config_in_the_run_folder_is_one_line(tiny_corpus, tmp_path, reference,
                                                          capsys):
    folder = _unfinished_copy(reference, tiny_corpus, tmp_path)
    _truncate(folder / "config.yaml", 0.3)
    assert main(["train", str(config_file(tiny_corpus, tmp_path))]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(folder / "config.yaml") in line, line


def test_a_truncated_corpus_shard_is_one_line_naming_it(tiny_corpus, tmp_path, reference, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, corpus)
    shard = corpus / "de" / "private" / "part-00000.parquet"
    _truncate(shard)
    config = config_file(corpus, tmp_path)
    assert main(["train", str(config)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(shard) in line and "unreadable corpus shard" in line, line
    assert status(folder_of(corpus, tmp_path))["state"] == "failed"


def test_a_truncated_results_file_under_table_is_one_line_naming_it(reference, tmp_path, capsys):
    for name in ("eval.parquet", "final.parquet"):
        results = tmp_path / name / "results"
        shutil.copytree(reference["folder"], results / "run")
        assert main(["table", str(results)]) == 0
        capsys.readouterr()
        _truncate(results / "run" / name)
        assert main(["table", str(results)]) == 2
        line = one_line_error(capsys.readouterr().err, "table")
        assert str(results / "run" / name) in line, line


def test_a_truncated_feature_cache_file_is_recomputed_and_the_run_is_identical(
        tiny_corpus, tmp_path, reference):
    # the corpus's path is in the run id, and the run id scopes the noise: the comparison is
    # with a run on the same copy whose cache is intact
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, corpus)
    cached = sorted((corpus / "features").rglob("*.pt"))
    assert cached, "the reference run fills the corpus's feature cache"
    intact = train_in_process(corpus, tmp_path / "intact")
    for path in cached:
        _truncate(path)
    folder = train_in_process(corpus, tmp_path / "recomputed")
    assert_identical(folder, {"folder": intact, **result(intact)})

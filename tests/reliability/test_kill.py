"""kill -9 and two writers: a run killed anywhere ends, when run again, identical to one never
interrupted (state bit for bit, every row once); a second writer on a live run is refused in one
line naming the holder and writes nothing; a killed holder's lock is taken over.

The default suite kills right after a checkpoint rename (with the second writer and the stale
lock in the same scenario); ``-m slow`` kills at every point of the probe: setup, round 1, round
2, the final evaluation, right after a rename, and during the temporary file's write.
"""

from __future__ import annotations

import pytest

from reliability_helpers import (Driven, assert_identical, cli, config_file, folder_of,
                                 one_line_error, status, temp_files, train_in_process)


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "log.txt"}


def test_second_writer_refused_then_killed_writer_taken_over_and_result_identical(
        tiny_corpus, tmp_path, reference):
    config = config_file(tiny_corpus, tmp_path)
    folder = folder_of(tiny_corpus, tmp_path)
    first = Driven("renamed:1", config)
    first.wait_paused()
    try:
        before = _snapshot(folder)
        second = cli("train", str(config))
        line = one_line_error(second.stderr)
        assert second.returncode == 2, second.stderr[-2000:]
        assert str(folder) in line and f"pid {first.proc.pid}" in line, line
        assert _snapshot(folder) == before  # the refused writer touched nothing
        assert status(folder)["state"] == "running" and status(folder)["pid"] == first.proc.pid
    finally:
        first.kill()  # SIGKILL to the process group: no handler runs, the lock goes stale
        first.finish()
    assert status(folder)["state"] == "running"  # what a kill leaves: the checkpoint of round 1
    train_in_process(tiny_corpus, tmp_path)  # takes the stale lock over and resumes
    assert "resumed from round 1" in (folder / "log.txt").read_text()
    assert_identical(folder, reference)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["setup", "round:1", "round:2", "eval", "renamed:2",
                                   "tmpwrite:2"])
def test_kill9_at_any_point_then_rerun_ends_identical(point, tiny_corpus, tmp_path, reference):
    config = config_file(tiny_corpus, tmp_path)
    folder = folder_of(tiny_corpus, tmp_path)
    run = Driven(point, config)
    run.wait_paused()
    run.kill()
    run.finish()
    if point == "tmpwrite:2":
        assert temp_files(folder), "the half-written checkpoint should be there before the rerun"
    # the rerun goes through the CLI, as a user (or a requeued job) would
    proc = cli("train", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_identical(folder, reference)

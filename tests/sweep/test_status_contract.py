"""One reader of status.json for the engine and the grid: absent = not started; present but
unreadable = a failed run that says so (never "not started", which the grid would resubmit
without a word while the engine refuses or resumes the folder)."""

from __future__ import annotations

import json

from cluster_fl.engine import rundir
from cluster_fl.sweep import status as status_mod


def test_absent_unreadable_and_valid_status(tmp_path):
    assert rundir.read_status(tmp_path) is None
    assert status_mod.decide(rundir.read_status(tmp_path), None) == "missing"
    (tmp_path / "status.json").write_text('{"state": "runn')  # cut short on a full disk
    st = rundir.read_status(tmp_path)
    assert st["state"] == "failed" and "unreadable status.json" in st["error"]
    assert status_mod.decide(st, None) == "failed"
    (tmp_path / "status.json").write_text("[1, 2]")
    assert rundir.read_status(tmp_path)["state"] == "failed"
    (tmp_path / "status.json").write_text(json.dumps({"state": "done", "round": 3}))
    assert rundir.read_status(tmp_path) == {"state": "done", "round": 3}
    assert status_mod.decide(rundir.read_status(tmp_path), None) == "done"


def test_the_grid_and_the_engine_share_the_reader():
    assert status_mod.read_status is rundir.read_status

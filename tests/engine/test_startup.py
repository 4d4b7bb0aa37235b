"""The start of a multi-rank run, with real gloo processes.

* Load phase under the long wait: building the world (corpus scan, model build, checkpoint
  load) ends with a barrier on the slow group, so a rank that loads 5 s late against a 2 s
  dead-peer limit is waited for, and a rank that dies while loading fails the job within the
  dead-peer limit plus a few seconds.
* Shared run folder: rank 0 writes a per-start token into the run folder; a rank that cannot
  read it (here: a rank whose run.out points at another folder, as a node whose mount differs
  would) stops the run before its first round with one line naming the folder and its host.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from engine_helpers import tiny_overrides, training_worker

from cluster_fl.distributed import RankFailure, spawn

DEAD_PEER_S = 2


def _slow_loader(comm, overrides, late_s: float, die: str | None):
    """Rank 1 loads its clients ``late_s`` late; with ``die`` (a file) it records the time and
    exits there instead. Rank 0 reports how its run ended and when."""
    from cluster_fl.engine import setup

    original = setup.load_clients

    def load_clients(*args, **kwargs):
        if comm.rank == 1:
            if die is not None:
                Path(die).write_text(repr(time.time()))
                os._exit(3)
            time.sleep(late_s)
        return original(*args, **kwargs)

    setup.load_clients = load_clients
    try:
        out = training_worker(comm, overrides)
        return {"end": "trained", "rows": out.get("rows")}
    except Exception as exc:  # noqa: BLE001 -- how it failed is the result
        return {"end": "failed", "at": time.time(), "error": f"{type(exc).__name__}: {exc}"}
    finally:
        setup.load_clients = original


@pytest.fixture(scope="module")
def overrides(tiny_corpus, reference_run, tmp_path_factory):
    # reference_run fills the shared feature cache first, so concurrent ranks only read it
    return lambda name, *extra: tiny_overrides(tiny_corpus, tmp_path_factory.mktemp(name),
                                               f"run.timeout_s={DEAD_PEER_S}", "fl.rounds=1",
                                               *extra)


def test_a_rank_that_loads_5_s_late_is_waited_for(overrides):
    out = spawn(_slow_loader, 2, overrides("late"), 5.0, None, timeout_s=240,
                comm_timeout_s=DEAD_PEER_S, wait_timeout_s=120, raise_on_error=False)
    assert [r.get("end") if isinstance(r, dict) else r for r in out] == ["trained", "trained"]
    assert [row["round"] for row in out[0]["rows"]] == [1]


@pytest.mark.slow  # ~13 s; a killed peer within the limit: tests/distributed/test_dist_comm.py
def test_a_rank_that_dies_while_loading_fails_the_job_within_the_dead_peer_limit(overrides,
                                                                                tmp_path):
    marker = tmp_path / "died"
    out = spawn(_slow_loader, 2, overrides("dies"), 0.0, str(marker), timeout_s=240,
                comm_timeout_s=DEAD_PEER_S, wait_timeout_s=600, raise_on_error=False)
    assert isinstance(out[1], RankFailure) and out[1].exitcode == 3
    assert out[0]["end"] == "failed", out[0]
    # rank 0 still builds its own world (a few seconds on a busy machine), then its first
    # collective sees the closed connection: not the 600 s wait limit
    waited = out[0]["at"] - float(marker.read_text())
    assert waited < DEAD_PEER_S + 15, (waited, out[0]["error"])
    assert "CommError" in out[0]["error"] or "collective" in out[0]["error"]


def _private_out(comm, overrides, private: str):
    """Rank 1 sees another folder at the run's path (its own run.out), as a node would whose
    mount of the results folder differs."""
    from cluster_fl.engine import startup

    if comm.rank == 1:
        overrides = [o for o in overrides if not o.startswith("run.out=")] + [f"run.out={private}"]
        startup.READ_WITHIN_S = 1.0  # the retry a slow mount gets (10 s) is not what is tested
    try:
        training_worker(comm, overrides)
        return {"end": "trained"}
    except Exception as exc:  # noqa: BLE001
        return {"end": "failed", "error": str(exc), "type": type(exc).__name__}


def test_a_rank_that_cannot_see_the_run_folder_stops_the_run_naming_folder_and_host(overrides,
                                                                                   tmp_path):
    args = overrides("unshared")
    out = spawn(_private_out, 2, args, str(tmp_path / "elsewhere"), timeout_s=240,
                comm_timeout_s=10, wait_timeout_s=120, raise_on_error=False)
    assert [r["end"] for r in out] == ["failed", "failed"], out
    line = out[0]["error"]
    assert out[0]["type"] == "UserError" and line == out[1]["error"] and "\n" not in line
    folder = next(o for o in args if o.startswith("run.out=")).split("=", 1)[1]
    assert f"run folder {folder}" in line and "is not shared: rank 1 on host" in line
    assert socket.gethostname() in line and "start token" in line


def test_ranks_that_found_different_checkpoints_are_refused():
    from cluster_fl.engine.startup import _verdict
    from cluster_fl.errors import UserError

    _verdict([(None, "a", "/r", 3), (None, "b", "/r", 3)])
    with pytest.raises(UserError, match="rank 1 on host b found the checkpoint of round 0, rank "
                                        "0 on host a that of round 3"):
        _verdict([(None, "a", "/r", 3), (None, "b", "/r", 0)])

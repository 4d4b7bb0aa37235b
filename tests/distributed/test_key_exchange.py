"""Secure mode's keys across real gloo ranks (item 4): the X25519 public keys carry a
tag under the job's secret and a key without it is refused; the cohort key and the secure seed
reach every rank encrypted under its pair key, never in plain on the wire."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

from cluster_fl.distributed import spawn
from cluster_fl.secure_sum import KeyAuthenticationError, agree_pair_keys, share_from_rank0

VALUE = bytes(range(32))


class WireSpy:
    """A communicator that keeps the pickled bytes of every object collective's payload."""

    def __init__(self, comm: Any):
        self._comm = comm
        self.wire: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        out = self._comm.broadcast_object(obj, src)
        self.wire.append(pickle.dumps(out))
        return out

    def all_gather_object(self, obj: Any, **kwargs: Any) -> Any:
        out = self._comm.all_gather_object(obj, **kwargs)
        self.wire.append(pickle.dumps(out))
        return out


def share_worker(comm: Any, secrets_by_rank: list[bytes]) -> dict[str, Any]:
    spy = WireSpy(comm)
    try:
        keys = agree_pair_keys(spy, secrets_by_rank[comm.rank])
    except KeyAuthenticationError as exc:
        return {"refused": str(exc)}
    got = share_from_rank0(spy, keys, VALUE if comm.rank == 0 else None, "cohort key")
    return {"got": got, "in_plain": any(VALUE in w for w in spy.wire)}


def test_a_shared_key_reaches_every_rank_and_never_travels_in_plain():
    secret = b"s" * 32
    for rank, out in enumerate(spawn(share_worker, 3, [secret] * 3, timeout_s=90)):
        assert out["got"] == VALUE and not out["in_plain"], rank


def test_a_public_key_without_the_job_secrets_tag_is_refused():
    outs = spawn(share_worker, 2, [b"s" * 32, b"x" * 32], timeout_s=90)
    assert all("job-secret tag" in out.get("refused", "") for out in outs), outs


def engine_worker(comm: Any, out_dir: str) -> dict[str, Any]:
    """A secure-mode RoundEngine of 2 ranks: its cohort key must not cross the wire in plain."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from engine_helpers import FakeRunner, engine_config, make_engine, random_update

    from cluster_fl.engine.operator_log import job_secret_path
    from cluster_fl.engine.rundir import run_dir

    cfg = engine_config("privacy.secure_mode=true", f"run.out={out_dir}")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=5, run_id="r"))
    if comm.rank == 0:
        path = job_secret_path(run_dir(cfg))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"k" * 32)
    comm.barrier()
    spy = WireSpy(comm)
    engine = make_engine(cfg, FakeRunner(random_update), 8, comm=spy)
    key = engine._cohort_key
    return {"key": key, "in_plain": any(key in w for w in spy.wire)}


def test_a_secure_engines_cohort_key_is_not_sent_in_plain(tmp_path):
    outs = spawn(engine_worker, 2, str(tmp_path), timeout_s=120)
    assert outs[0]["key"] == outs[1]["key"] and len(outs[0]["key"]) == 32
    assert not any(out["in_plain"] for out in outs)


def test_one_process_shares_without_the_wire():
    from cluster_fl.distributed import LocalComm

    assert share_from_rank0(LocalComm(), {}, VALUE, "cohort key") == VALUE


def test_a_two_rank_secure_run_agrees_its_keys_through_the_job_secret(tiny_corpus, tmp_path):
    """End to end: the job secret written at start authenticates the exchange that hands the
    drawn seed and the cohort key to rank 1; the run ends valid, the secret outside the folder."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from engine_helpers import tiny_overrides, training_worker

    out = spawn(training_worker, 2, tiny_overrides(tiny_corpus, tmp_path,
                                                   "privacy.secure_mode=true", "fl.rounds=1"),
                timeout_s=400)
    import json

    folder = Path(out[1]["folder"])
    assert json.loads((folder / "privacy.json").read_text())["guarantee"] == "valid"
    assert out[0]["round"] == 1
    secret = (folder.parent / ".operator" / f"{folder.name}.secret")
    assert len(secret.read_bytes()) == 32 and (secret.stat().st_mode & 0o777) == 0o600

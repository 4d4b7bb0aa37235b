"""What a run folder may hand a resume, and what it may not: files are data, never
code; a checkpoint is verified whole; a checkpoint path that is not a checkpoint file is refused
before anything in the folder is touched.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest
import torch

from reliability_helpers import config_file, folder_of, one_line_error, status

from cluster_fl.cli import main
from cluster_fl.engine.checkpoint import load_run_checkpoint
from cluster_fl.errors import UserError


def _unfinished_copy(reference, tiny_corpus, out, round_=2):
    """The reference run's folder under ``out``, set back to 'running' after ``round_``."""
    folder = folder_of(tiny_corpus, out)
    shutil.copytree(reference["folder"], folder)
    st = status(folder)
    st.update(state="running", round=round_)
    (folder / "status.json").write_text(json.dumps(st))
    (folder / "final.parquet").unlink()
    return folder


class _RunsCode:
    """A pickle that runs a command when loaded (what a crafted state.pt carries)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_carries_code_is_refused_and_the_code_never_runs(
        tiny_corpus, tmp_path, reference):
    from cluster_fl.audit.record import scan_record

    folder = _unfinished_copy(reference, tiny_corpus, tmp_path)
    ckpt = folder / "checkpoint" / "state.pt"
    marker = tmp_path / "pwned"
    real = torch.load(ckpt, map_location="cpu", weights_only=True)
    real["rows"] = [_RunsCode(str(marker))]
    buf = io.BytesIO()
    torch.save(real, buf)
    ckpt.write_bytes(buf.getvalue())
    with pytest.raises(UserError, match="unreadable"):
        load_run_checkpoint(folder)
    scan_record(folder)  # the audit reads the checkpoint's rows too
    assert not marker.exists()


def test_another_runs_checkpoint_and_ledger_copied_in_are_refused(tiny_corpus, tmp_path,
                                                                   reference, capsys):
    """Run B has the same config as the reference run A; A's state.pt and privacy.json copied
    into B's folder must not be resumed (B's nonce, drawn at its first start, differs)."""
    import yaml

    folder = _unfinished_copy(reference, tiny_corpus, tmp_path)
    own = yaml.safe_load((folder / "config.yaml").read_text())
    assert len(own["run"]["nonce"]) == 32  # drawn at A's first start, stored in its config
    own["run"]["nonce"] = "0" * 32  # B's config.yaml: B's own first start
    (folder / "config.yaml").write_text(yaml.safe_dump(own, sort_keys=False))
    rows = (folder / "rounds.parquet").read_bytes()
    assert main(["train", str(config_file(tiny_corpus, tmp_path))]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "another run" in line and "state.pt" in line, line
    assert (folder / "rounds.parquet").read_bytes() == rows
    # the ledger alone, copied in with B's own checkpoint, is refused too
    from cluster_fl.config import load_config
    from cluster_fl.engine.ledger import RunLedger
    from cluster_fl.privacy import ledger_for

    ledger = RunLedger(ledger_for(load_config(None, []), population=100), None)
    ledger.attach(folder, main=False, nonce="0" * 32)
    with pytest.raises(UserError, match="another run"):
        ledger.resume(None)


def test_a_checkpoint_with_changed_rows_fails_its_checksum(tiny_corpus, tmp_path, reference):
    folder = _unfinished_copy(reference, tiny_corpus, tmp_path)
    ckpt = folder / "checkpoint" / "state.pt"
    data = torch.load(ckpt, map_location="cpu", weights_only=True)
    load_run_checkpoint(folder)  # as written: verified
    data["rows"][0]["loss"] = 0.0  # the trainable state and its digest untouched
    buf = io.BytesIO()
    torch.save(data, buf)
    ckpt.write_bytes(buf.getvalue())
    with pytest.raises(UserError, match="damaged"):
        load_run_checkpoint(folder)


def test_a_folder_at_state_pt_is_an_error_before_any_file_is_touched(tiny_corpus, tmp_path,
                                                                    reference, capsys):
    folder = _unfinished_copy(reference, tiny_corpus, tmp_path)
    ckpt = folder / "checkpoint" / "state.pt"
    ckpt.unlink()
    ckpt.mkdir()
    before = {p.name: p.read_bytes() for p in folder.iterdir()
              if p.is_file() and p.name not in ("status.json", "run.lock")}
    assert main(["train", str(config_file(tiny_corpus, tmp_path))]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(ckpt) in line and "not a checkpoint file" in line, line
    after = {p.name: p.read_bytes() for p in folder.iterdir()
             if p.is_file() and p.name not in ("status.json", "run.lock")}
    assert after == before
    assert status(folder)["state"] == "failed"


def test_a_finished_run_answers_only_for_its_own_config(tiny_corpus, tmp_path, reference,
                                                         capsys):
    """``run.run_id=shared`` on a finished alpha-split run: the same config hears "already
    finished"; flat clipping is refused instead of being handed the alpha-split folder."""
    import yaml

    folder = tmp_path / "default" / "shared"
    shutil.copytree(reference["folder"], folder)
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    cfg["run"]["run_id"] = "shared"
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    same = config_file(tiny_corpus, tmp_path, "run.run_id=shared")
    assert main(["train", str(same)]) == 0
    assert "already finished" in capsys.readouterr().err
    other = config_file(tiny_corpus, tmp_path, "run.run_id=shared", "privacy.clipping=flat")
    assert main(["train", str(other)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "different config" in line and "privacy.clipping" in line, line
    assert status(folder)["state"] == "done"


def test_the_run_folder_keeps_no_wall_clock_time(reference, tmp_path):
    """run.lock kept the attempt's start, status.json its last write, and the files' times told
    the same; the audit's record scan did not read run.lock."""
    from cluster_fl.audit.record import scan_record
    from cluster_fl.engine.rundir import read_status

    folder = reference["folder"]
    assert "updated" not in json.loads((folder / "status.json").read_text())
    assert "since" not in json.loads((folder / "run.lock").read_text() or "{}")
    dated = [str(p.relative_to(folder)) for p in [folder, *folder.rglob("*")]
             if p.stat().st_mtime != 0]
    assert dated == []
    assert read_status(folder).get("updated")  # the grid's staleness check still has it
    assert scan_record(folder)["timing"] == []
    old = tmp_path / "older-run"
    shutil.copytree(folder, old)
    (old / "run.lock").write_text(json.dumps({"host": "h", "pid": 1, "since": "2026-01-01"}))
    assert "run.lock: key 'since'" in scan_record(old)["timing"]

"""What a run folder may hand a resume, and what it may not (issue 49): files are data, never
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

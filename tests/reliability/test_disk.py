"""A disk that fills up, a run folder that cannot be written: one line naming the file, exit 2,
status.json ``failed`` with the reason, nothing half-written left; freed, the run reruns to the
identical result.

The default test caps the size of any file the child may write (``RLIMIT_FSIZE``: a write past
it fails with EFBIG, as on a full disk) so that the first checkpoint cannot be written; ``-m slow``
adds a real full disk (a 400 KB tmpfs, ENOSPC; root only) and a read-only bind mount (EROFS).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from reliability_helpers import (assert_identical, cli, config_file, folder_of, one_line_error,
                                 status, temp_files, train_in_process)

CHECKPOINT_LIMIT = 200_000  # bytes: rounds.parquet (~25 KB) fits, the checkpoint (~470 KB) not


def _cap_file_size(nbytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def test_a_file_size_cap_fails_the_checkpoint_in_one_line_and_the_rerun_is_identical(
        tiny_corpus, tmp_path, reference):
    config = config_file(tiny_corpus, tmp_path)
    folder = folder_of(tiny_corpus, tmp_path)
    proc = cli("train", str(config), preexec=_cap_file_size(CHECKPOINT_LIMIT))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line_error(proc.stderr)
    assert str(folder / "checkpoint" / "state.pt") in line and "File too large" in line, line
    st = status(folder)
    assert st["state"] == "failed" and "state.pt" in st["error"] and "File too large" in st["error"]
    assert temp_files(folder) == []
    assert "failed: cannot write" in (folder / "log.txt").read_text()
    train_in_process(tiny_corpus, tmp_path)  # space again: the same run, from the start
    assert_identical(folder, reference)


def _mount(*args: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount")
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} refused: {proc.stderr.strip()}")


@pytest.mark.slow
def test_a_full_tmpfs_is_one_line_a_failed_status_and_no_temp_file(tiny_corpus, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount("-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk))
    try:
        config = config_file(tiny_corpus, tmp_path / "cfg")
        proc = cli("train", str(config), f"run.out={disk}")
        folder = Path(folder_of(tiny_corpus, disk))
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = one_line_error(proc.stderr)
        assert "No space left on device" in line and str(folder) in line, line
        st = status(folder)  # written in place: its block was already there
        assert st["state"] == "failed" and "No space left on device" in st["error"]
        assert temp_files(folder) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_a_read_only_run_folder_is_one_line(tiny_corpus, tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    _mount("--bind", str(out), str(out))
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(out)], check=True)
        config = config_file(tiny_corpus, tmp_path / "cfg")
        proc = cli("train", str(config), f"run.out={out}")
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Read-only file system" in one_line_error(proc.stderr)
    finally:
        subprocess.run(["umount", str(out)], check=False)


@pytest.mark.parametrize("where", ["a file", "under /proc"])
def test_run_out_that_cannot_hold_a_folder_is_one_line_naming_run_out(where, tiny_corpus,
                                                                      tmp_path, capsys):
    from cluster_fl.cli import main

    if where == "a file":
        target = tmp_path / "plain-file"
        target.write_text("x")
    else:
        target = Path("/proc/cluster-fl-cannot-be-here")
    config = config_file(tiny_corpus, tmp_path / "cfg")
    assert main(["train", str(config), f"run.out={target}"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "run.out" in line and str(target) in line, line

"""The run folder's writer lock, temporary-file clean-up, and writes that fail in one line.

- a second holder of ``run.lock`` (another process) is refused with the first's host and pid;
- a holder that died leaves a stale lock that the next writer takes over;
- temporary files of killed writers (``.state.pt.tmp<pid>``, ``.status.json.tmp<pid>``) are
  removed, and nothing else is;
- a failed write is a :class:`WriteError` naming the file and leaves no temporary file;
- on a full disk status.json is still rewritten (in place).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

from cluster_fl.engine import rundir
from cluster_fl.engine.rundir import (RunLock, RunLocked, WriteError, atomic_write_bytes,
                                      clean_temp_files, read_status, write_status)

HOLD = textwrap.dedent("""
    import sys, time
    from cluster_fl.engine.rundir import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("HELD", flush=True)
    time.sleep(60)
""")


def _holder(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunLocked) as exc:
            RunLock(tmp_path).acquire()
        assert f"pid {holder.pid}" in str(exc.value) and str(tmp_path) in str(exc.value)
        assert exc.value.holder["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path) as lock:  # stale: the kernel dropped the dead holder's lock
        info = json.loads((tmp_path / "run.lock").read_text())
        assert info["pid"] == os.getpid() and lock.enforced
    with RunLock(tmp_path):  # released on exit: taken again
        pass


def test_clean_temp_files_removes_only_what_killed_writers_left(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    left = [tmp_path / ".status.json.tmp123", tmp_path / "checkpoint" / ".state.pt.tmp99",
            tmp_path / ".rounds.parquet.tmp-7"]
    kept = [tmp_path / "status.json", tmp_path / "run.lock", tmp_path / ".hidden",
            tmp_path / "checkpoint" / "state.pt", tmp_path / "notes.tmp1"]
    for p in left + kept:
        p.write_text("x")
    assert sorted(clean_temp_files(tmp_path)) == sorted(left)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in left)


def test_a_failed_write_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "state.pt"

    def fail_fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "fsync", fail_fsync)
    with pytest.raises(WriteError) as exc:
        atomic_write_bytes(target, b"x" * 1000)
    assert str(target) in str(exc.value) and "No space left" in str(exc.value)
    assert exc.value.errno == errno.ENOSPC
    assert list((tmp_path / "sub").iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.undo()
    with pytest.raises(WriteError, match="File exists|Not a directory"):
        atomic_write_bytes(blocker / "status.json", b"{}")


def test_status_is_written_in_place_when_the_disk_is_full(tmp_path, monkeypatch):
    write_status(tmp_path, "running", 3, 10)

    def full(path, data):
        raise WriteError(path, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(rundir, "atomic_write_bytes", full)
    write_status(tmp_path, "failed", 3, 10, error="cannot write x: No space left on device")
    st = read_status(tmp_path)
    assert st["state"] == "failed" and "No space" in st["error"]
    other = tmp_path / "fresh"
    other.mkdir()
    with pytest.raises(WriteError):  # nothing to overwrite: the failure stands
        write_status(other, "failed", 0, 10)

"""``cluster-fl audit`` on the wrong folder, or one it cannot write: one line, exit 2, and nothing
written where it does not belong (the battery does not even start)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from cluster_fl.cli import main


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("cluster-fl audit: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_folder_that_is_not_a_run_is_refused_and_left_untouched(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("my thesis")
    assert main(["audit", str(tmp_path)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "not a run folder" in line and str(tmp_path) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_report_folder_that_cannot_be_written_is_one_line_before_the_battery(tmp_path):
    from cluster_fl.audit.synthetic import write_synthetic_run

    run = write_synthetic_run(tmp_path / "run", n_speakers=8, rounds=2, canaries=8)

    def no_writes() -> None:  # any write past 0 bytes fails (EFBIG), for root too
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    proc = subprocess.run([sys.executable, "-m", "cluster_fl", "audit", str(run)],
                          capture_output=True, text=True, timeout=120, preexec_fn=no_writes,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _error_line(proc.stderr)
    assert str(run / "audit") in line and "--out" in line, line
    assert not any((run / "audit").iterdir())


@pytest.mark.slow
def test_a_read_only_run_folder_is_one_line(tmp_path):
    import shutil

    from cluster_fl.audit.synthetic import write_synthetic_run

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount")
    run = write_synthetic_run(tmp_path / "run", n_speakers=8, rounds=2, canaries=8)
    if subprocess.run(["mount", "--bind", str(run), str(run)]).returncode != 0:
        pytest.skip("bind mount refused")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(run)], check=True)
        proc = subprocess.run([sys.executable, "-m", "cluster_fl", "audit", str(run)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Read-only file system" in _error_line(proc.stderr)
    finally:
        subprocess.run(["umount", str(run)], check=False)

"""The four promises the hostile-user probe found broken, with real processes and files.

1. Two SIGTERMs during the final evaluation -- the second one inside the write of the
   ``preempted`` status (deterministic), or 0.2 s after the first (from outside) -- end with
   exit 75 and status ``preempted``, never ``running`` and never exit -15.
2. Two bytes flipped inside the checkpoint's tensor data: the resume refuses in one line (exit
   2, status ``failed``) instead of continuing silently from damaged state.
3. A checkpoint copied in from another run: from a run with other settings (its id differs), or
   from a longer run with the same id (the run's write-ahead ledger is behind it): one line,
   exit 2, status ``failed`` -- never "resumed from round 40", done, with a stale row and ε.
4. An emptied or garbled config.yaml in the run folder: one line, exit 2, status ``failed``.

One run killed after round 1's checkpoint (``renamed:1``) is the base: each probe works on its
own copy of that folder (the run id, hence the folder's name, stays; ``run.out`` differs).
"""

from __future__ import annotations

import shutil
import signal
import time
import zipfile
from pathlib import Path

import pytest

from reliability_helpers import (Driven, cli, config_file, folder_of, one_line_error, status,
                                 temp_files)

from cluster_fl.errors import PREEMPTED_EXIT
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)


@pytest.fixture(scope="module")
def killed_after_round_1(tiny_corpus, tmp_path_factory, reference) -> Path:
    """A run folder whose writer was SIGKILLed right after round 1's checkpoint."""
    out = tmp_path_factory.mktemp("probe_base")
    run = Driven("renamed:1", config_file(tiny_corpus, out))
    run.wait_paused()
    run.kill()
    run.finish()
    return folder_of(tiny_corpus, out)


def _copy(base: Path, tiny_corpus: Path, out: Path, *extra: str) -> tuple[Path, Path]:
    """``base`` copied to the run folder of the same config under ``out``; (config, folder)."""
    config = config_file(tiny_corpus, out, *extra)
    folder = folder_of(tiny_corpus, out, *extra)
    shutil.copytree(base, folder)
    return config, folder


def _refused(config: Path, folder: Path, *words: str) -> str:
    proc = cli("train", str(config))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line_error(proc.stderr)
    assert all(w in line for w in words), line
    st = status(folder)
    assert st["state"] == "failed" and st["error"] and st["error"] in line, st
    assert not (folder / "final.parquet").exists()
    return line


# the second signal at once (eval-twice) is `slow` (.ci/run's slow stage); 0.2 s apart stays default
@pytest.mark.parametrize("point,gap_s", [pytest.param("eval-twice", 0.0, marks=pytest.mark.slow),
                                         ("eval", 0.2)])
def test_two_sigterms_while_stopping_leave_preempted_and_exit_75(point, gap_s, tiny_corpus,
                                                                 tmp_path, reference):
    config = config_file(tiny_corpus, tmp_path)
    folder = folder_of(tiny_corpus, tmp_path)
    run = Driven(point, config)
    run.wait_paused()
    run.kill(signal.SIGTERM)
    if gap_s:
        time.sleep(gap_s)
        run.kill(signal.SIGTERM)
    rc, err = run.finish()
    assert rc == PREEMPTED_EXIT, (rc, err[-3000:])
    assert "Traceback" not in err
    st = status(folder)
    assert (st["state"], st["round"]) == ("preempted", 3), st
    assert temp_files(folder) == []


def _tensor_member(path: Path) -> tuple[int, int]:
    """(offset in the file, length) of the largest tensor record of a torch zip checkpoint."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = path.read_bytes()
    start = info.header_offset
    name_len = int.from_bytes(raw[start + 26:start + 28], "little")
    extra_len = int.from_bytes(raw[start + 28:start + 30], "little")
    return start + 30 + name_len + extra_len, info.file_size


def test_flipped_bytes_in_the_checkpoints_tensors_are_refused(killed_after_round_1, tiny_corpus,
                                                              tmp_path):
    config, folder = _copy(killed_after_round_1, tiny_corpus, tmp_path)
    ckpt = folder / "checkpoint" / "state.pt"
    offset, length = _tensor_member(ckpt)
    raw = bytearray(ckpt.read_bytes())
    for i in (offset + length // 3, offset + length // 2):
        raw[i] ^= 0xFF
    ckpt.write_bytes(bytes(raw))
    _refused(config, folder, str(ckpt), "damaged")


def test_a_checkpoint_copied_in_from_another_run_is_refused(killed_after_round_1, tiny_corpus,
                                                           tmp_path, reference):
    longer = reference["folder"] / "checkpoint" / "state.pt"  # 3 rounds, done
    # another run's settings (2 rounds): another id -- the checkpoint names its run
    config, folder = _copy(killed_after_round_1, tiny_corpus, tmp_path / "other", "fl.rounds=2")
    from cluster_fl.engine.rundir import write_config
    from reliability_helpers import overrides

    write_config(folder, resolved_config(None, overrides(tiny_corpus, tmp_path / "other",
                                                     "fl.rounds=2")))
    shutil.copy(longer, folder / "checkpoint" / "state.pt")
    _refused(config, folder, "belongs to run", reference["folder"].name)
    # the same run's id and config, but another run: its nonce differs
    config, folder = _copy(killed_after_round_1, tiny_corpus, tmp_path / "same")
    shutil.copy(longer, folder / "checkpoint" / "state.pt")
    _refused(config, folder, "state.pt", "belongs to another run")
    # this very run's checkpoint, further along than its ledger: the ledger is behind it
    import io

    import torch
    import yaml

    from cluster_fl.engine.checkpoint import CONTENT_KEY, content_digest

    config, folder = _copy(killed_after_round_1, tiny_corpus, tmp_path / "ahead")
    ckpt = torch.load(longer, map_location="cpu", weights_only=True)
    ckpt["run_nonce"] = yaml.safe_load((folder / "config.yaml").read_text())["run"]["nonce"]
    ckpt[CONTENT_KEY] = content_digest({k: v for k, v in ckpt.items() if k != CONTENT_KEY})
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    (folder / "checkpoint" / "state.pt").write_bytes(buf.getvalue())
    _refused(config, folder, "privacy.json", "behind the checkpoint of round 3")


@pytest.mark.parametrize("damage", ["", "model: [unclosed\n  arch: {"])
def test_an_emptied_or_garbled_config_is_refused(damage, killed_after_round_1, tiny_corpus,
                                                 tmp_path):
    config, folder = _copy(killed_after_round_1, tiny_corpus, tmp_path)
    (folder / "config.yaml").write_text(damage)
    _refused(config, folder, "config.yaml", "unreadable")

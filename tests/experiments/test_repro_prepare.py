"""launch/repro_prepare.sh: the study's inputs are checked against the protocol's digests by
re-hashing what is on disk -- a corpus that is not the protocol's render is refused before any
pretraining, and a shard changed after rendering is caught even though its manifest still
carries the old digest."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "repro_prepare.sh"


def _prepare(home: Path, *parts: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *parts], env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_scripts_digests_are_the_ones_the_protocol_and_log_record():
    script = SCRIPT.read_text()
    record = (REPO / "results" / "repro" / "PROTOCOL.md").read_text() + \
        (REPO / "results" / "LOG.md").read_text()
    digests = re.findall(r"^[A-Z_0-9]+=([0-9a-f]{64})$", script, flags=re.M)
    assert len(digests) == 4
    for digest in digests:
        assert digest in record, digest


def test_a_corpus_that_is_not_the_protocols_render_is_refused(tiny_corpus, tmp_path):
    import json

    corpus = tmp_path / ".cache" / "cluster_fl" / "corpus-v3"
    shutil.copytree(tiny_corpus, corpus)
    manifest = json.loads((corpus / "manifest.json").read_text())
    done = _prepare(tmp_path, "main")
    assert done.returncode == 1
    # the digest it computed from the files is the manifest's rule applied to them
    assert f"differs from the protocol's: {manifest['digest']} (want d9eec085" in done.stderr
    assert not (tmp_path / ".cache" / "cluster_fl" / "pretrain").exists()  # stopped first

    shard = corpus / manifest["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    tampered = _prepare(tmp_path, "main")
    assert tampered.returncode == 1 and "differs from the protocol's" in tampered.stderr
    assert manifest["digest"] not in tampered.stderr  # re-hashed, not read from the manifest


def test_an_unknown_part_is_a_usage_error(tmp_path):
    done = _prepare(tmp_path, "everything")
    assert done.returncode == 2 and "usage:" in done.stderr

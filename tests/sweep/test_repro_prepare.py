"""launch/repro_prepare.sh: the study's inputs are checked against the protocol's digests by
re-hashing what is on disk -- a corpus that is not the protocol's render is refused before any
pretraining, a shard changed after rendering is caught even though its manifest still carries
the old digest, and the starting model is the committed bytes (results/repro/starting-model/)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "repro_prepare.sh"
COMMITTED = REPO / "results" / "repro" / "starting-model"


def _prepare(home: Path, *parts: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *parts], env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_digests_are_the_ones_the_protocol_and_log_record():
    script = SCRIPT.read_text()
    record = (REPO / "results" / "repro" / "PROTOCOL.md").read_text() + \
        (REPO / "results" / "LOG.md").read_text()
    corpora = re.findall(r"^CORPUS_[A-Z0-9]+=([0-9a-f]{64})$", script, flags=re.M)
    models = [line.split()[0] for line in (COMMITTED / "SHA256SUMS").read_text().splitlines()]
    assert len(corpora) == 2 and models
    for digest in corpora + models:
        assert digest in record, digest


def test_the_committed_starting_model_is_put_in_place_and_checked(tmp_path):
    """The study's starting model comes from the repository's bytes, not from a rebuild on
    whatever CPU this is; a cached copy with other bytes is refused."""
    done = _prepare(tmp_path, "starting-model")
    assert done.returncode == 0, done.stderr
    placed = tmp_path / ".cache" / "cluster_fl" / "pretrain" / "corpus-v3" / \
        "repro-joint-5600steps"
    want = (COMMITTED / "SHA256SUMS").read_text().split()[0]
    assert hashlib.sha256((placed / "model.pt").read_bytes()).hexdigest() == want
    assert (placed / "meta.json").is_file() and (placed / "tokenizer" / "tokenizer.json").is_file()

    (placed / "model.pt").write_bytes(b"rebuilt on another CPU")
    refused = _prepare(tmp_path, "starting-model")
    assert refused.returncode == 1 and f"(want {want})" in refused.stderr


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


def test_the_study_script_runs_the_protocols_grids_and_refuses_an_unknown_step(tmp_path):
    """launch/repro_study.sh: each grid it names exists; a typo stops before anything runs."""
    study = REPO / "launch" / "repro_study.sh"
    code = "\n".join(line for line in study.read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    named = set(re.findall(r"\bgrid ([a-z-]+|\"\$step\")", code))
    grids = {n for n in named if not n.startswith('"')} | {"heavy", "mild"}  # "$step"
    assert grids == {"lr-sweep", "heavy", "mild", "eurollm", "private"}
    for name in grids:
        assert (REPO / "configs" / "grids" / f"repro-{name}.yaml").is_file(), name
    done = subprocess.run(["bash", str(study), "sweeep"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 2 and "usage:" in done.stderr

"""The demo starts from the study's committed starting model: placed in the cache, checked against
its SHA-256, refused when the bytes differ, and left alone where there is none."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cluster_fl.commands import demo
from cluster_fl.config import load_config
from cluster_fl.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def _committed(root: Path, arch: str = "whisper-tinyllama-tiny", payload: bytes = b"weights") -> Path:
    model = root / demo.STARTING_MODEL
    (model / "tokenizer").mkdir(parents=True)
    (model / "model.pt").write_bytes(payload)
    (model / "meta.json").write_text(json.dumps({"arch": arch, "step": 5600, "wer": 0.259}))
    (model / "tokenizer" / "vocab.json").write_text("{}")
    (root / "SHA256SUMS").write_text(
        f"{'0' * 64}  other/model.pt\n"
        f"{hashlib.sha256(payload).hexdigest()}  {demo.STARTING_MODEL}/model.pt\n")
    return root


def test_the_committed_model_is_copied_whole_into_the_cache_and_reused(tmp_path):
    committed = _committed(tmp_path / "committed")
    cache = tmp_path / "cache"
    got = demo.committed_starting_model(cache, Path("corpus-v3"), "whisper-tinyllama-tiny", committed)
    assert got == cache / "pretrain" / "corpus-v3" / demo.STARTING_MODEL
    assert (got / "model.pt").read_bytes() == b"weights"
    assert (got / "tokenizer" / "vocab.json").is_file() and (got / "meta.json").is_file()
    assert not got.with_name(got.name + ".partial").exists()
    # the second call checks the copy in place: the committed one is not read again
    (committed / demo.STARTING_MODEL / "model.pt").unlink()
    (committed / demo.STARTING_MODEL / "model.pt").write_bytes(b"weights")
    stamp = (got / "model.pt").stat().st_mtime_ns
    assert demo.committed_starting_model(cache, Path("corpus-v3"), "whisper-tinyllama-tiny",
                                         committed) == got
    assert (got / "model.pt").stat().st_mtime_ns == stamp


def test_a_cached_copy_with_other_bytes_is_refused(tmp_path):
    committed = _committed(tmp_path / "committed")
    cache = tmp_path / "cache"
    got = demo.committed_starting_model(cache, Path("corpus-v3"), "whisper-tinyllama-tiny", committed)
    (got / "model.pt").write_bytes(b"weightz")
    with pytest.raises(UserError, match="SHA-256"):
        demo.committed_starting_model(cache, Path("corpus-v3"), "whisper-tinyllama-tiny", committed)


def test_a_committed_model_that_does_not_match_its_sums_is_refused(tmp_path):
    committed = _committed(tmp_path / "committed")
    (committed / demo.STARTING_MODEL / "model.pt").write_bytes(b"tampered")
    with pytest.raises(UserError, match="SHA-256"):
        demo.committed_starting_model(tmp_path / "cache", Path("corpus-v3"),
                                      "whisper-tinyllama-tiny", committed)


def test_without_a_committed_model_for_the_arch_the_demo_pretrains_its_own(tmp_path):
    assert demo.committed_starting_model(tmp_path / "cache", Path("corpus-v3"),
                                         "whisper-tinyllama-tiny", tmp_path / "none") is None
    committed = _committed(tmp_path / "committed", arch="whisper-eurollm-tiny")
    assert demo.committed_starting_model(tmp_path / "cache", Path("corpus-v3"),
                                         "whisper-tinyllama-tiny", committed) is None
    assert not (tmp_path / "cache").exists()


def test_the_checkouts_starting_model_is_the_one_the_demo_config_names(tmp_path):
    """This checkout commits the study's model, the demo takes it, and the demo config's
    checkpoint (what `cluster-fl train` of the file reads after a demo) is where it goes."""
    got = demo.committed_starting_model(tmp_path, Path("corpus-v3"), "whisper-tinyllama-tiny")
    sums = (demo.COMMITTED / "SHA256SUMS").read_text()
    assert got is not None and f"{hashlib.sha256((got / 'model.pt').read_bytes()).hexdigest()}  " \
        f"{demo.STARTING_MODEL}/model.pt" in sums
    cfg = load_config(demo.DEMO_CONFIG, [])
    assert Path(cfg.model.checkpoint).name == demo.STARTING_MODEL
    assert Path(cfg.model.checkpoint).parent.name == got.parent.name == "corpus-v3"
    assert demo.COMMITTED == REPO / "results" / "repro" / "starting-model"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("extra, pretrains", [([], False), (["--pretrain-steps", "5"], True),
                                               (["--speakers-per-language", "3"], True)])
def test_the_demo_takes_the_committed_model_unless_asked_to_pretrain(tmp_path, monkeypatch,
                                                                     capsys, extra, pretrains):
    import argparse

    import cluster_fl.data as data
    import cluster_fl.training.pretrain as pretrain

    def stop(name):
        def raise_(*args, **kwargs):
            raise _Stop(name)
        return raise_

    monkeypatch.setattr(data, "make_corpus", lambda *a, **k: {})
    monkeypatch.setattr(pretrain, "pretrain", stop("pretrain"))
    monkeypatch.setattr(data, "count_clients", stop("federated stage"))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--cache", str(tmp_path), *extra])
    with pytest.raises(_Stop) as stopped:
        demo.run(args)
    assert str(stopped.value) == ("pretrain" if pretrains else "federated stage")
    said = capsys.readouterr().err
    assert ("the study's starting model" in said) is not pretrains, said
    assert (tmp_path / "pretrain" / "corpus-v3" / demo.STARTING_MODEL).exists() is not pretrains

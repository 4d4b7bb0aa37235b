"""The feature cache is keyed by the audio's content and the feature parameters.

- a shard whose audio changed (same path) gets new features, never the old ones;
- a shard that was only touched (same bytes, new modification time) is read from the cache;
- rows that could not be used are reported again when their shard comes from the cache;
- the cache is versioned: FEATURE_VERSION 3 (per speaker, content key) lives in its own folder.
"""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cluster_fl.data import CorpusWarning, FeatureStore
from cluster_fl.data.store import FEATURE_VERSION
from cluster_fl.data.mls import Shard

SHARD = ("en", "private")


@pytest.fixture
def corpus(tiny_corpus, tmp_path):
    root = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, root, ignore=shutil.ignore_patterns("features"))
    return root


def _shard(root):
    lang, split = SHARD
    return Shard(str(root / lang / split / "part-00000.parquet"), lang, split)


def _rewrite(shard, change):
    """Rewrite a shard's audio column with ``change(list of audio cells)``."""
    table = pq.read_table(shard.path)
    audio = table.column("audio").to_pylist()
    change(audio)
    table = table.set_column(table.schema.get_field_index("audio"), "audio",
                             pa.array(audio, type=table.schema.field("audio").type))
    pq.write_table(table, shard.path)


def test_changed_audio_is_recomputed_and_a_touched_shard_is_not(corpus, tmp_path):
    cache = tmp_path / "cache"
    shard = _shard(corpus)
    first = FeatureStore(corpus, cache, progress=False)
    before = first.shard_features(shard)
    speakers = len(first.index(shard)["speakers"])  # one part per speaker of the shard
    assert speakers > 1 and first.computed_parts == speakers
    again = FeatureStore(corpus, cache, progress=False)
    assert set(again.shard_features(shard)) == set(before) and again.computed_parts == 0

    st = os.stat(shard.path)
    os.utime(shard.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes
    touched = FeatureStore(corpus, cache, progress=False)
    touched.shard_features(shard)
    assert touched.computed_parts == 0

    ids = list(before)
    _rewrite(shard, lambda audio: audio.__setitem__(0, audio[1]))  # row 0 now sounds like row 1
    changed = FeatureStore(corpus, cache, progress=False)
    after = changed.shard_features(shard)
    assert changed.computed_parts == speakers  # the shard's bytes key every speaker's part
    assert not torch.equal(after[ids[0]], before[ids[0]])
    assert torch.equal(after[ids[0]], before[ids[1]])


def test_unusable_rows_are_reported_again_when_their_shard_is_cached(corpus, tmp_path):
    cache = tmp_path / "cache"
    shard = _shard(corpus)
    _rewrite(shard, lambda audio: audio.__setitem__(2, {"bytes": b"not audio",
                                                         "path": "bad.flac"}))
    bad = pq.read_table(shard.path).column("utterance_id").to_pylist()[2]
    with pytest.warns(CorpusWarning, match=bad):
        first = FeatureStore(corpus, cache, progress=False)
        first.shard_features(shard)
    with pytest.warns(CorpusWarning, match=bad):
        cached = FeatureStore(corpus, cache, progress=False)
        feats = cached.shard_features(shard)
    assert cached.computed_parts == 0 and bad not in feats
    assert [e["utterance_id"] for e in cached.errors] == [bad]
    assert cached.errors[0]["reason"] == first.errors[0]["reason"]
    cached.release()
    cached.shard_features(shard)  # read again: still reported once
    assert len(cached.errors) == 1


def test_the_cache_is_versioned(corpus, tmp_path):
    assert FEATURE_VERSION == 3
    store = FeatureStore(corpus, tmp_path / "cache", progress=False)
    store.shard_features(_shard(corpus))
    blob = torch.load(next((tmp_path / "cache").rglob("*.pt")), weights_only=True)
    assert len(blob["source"]["sha256"]) == 64 and blob["params_hash"] == store.params_hash

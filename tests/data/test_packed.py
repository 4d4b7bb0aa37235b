"""Packed client features (cluster_fl/data/packed.py): a batch padded where the features live is
:func:`pad_examples`' batch bit for bit, and the run's batches (``make_batches``) are the ones it
made before packing existed, from a list of examples or from their packed form."""

from __future__ import annotations

import pytest
import torch

from reference_batches import old_batches

from cluster_fl.data.features import Example, pad_examples
from cluster_fl.data.packed import pack_examples


def _examples(n: int = 9, seed: int = 0, dtype: torch.dtype = torch.float16) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g).tolist()
    return [Example((torch.randn(8, t, generator=g) * 3 - 2).to(dtype), f"text {i}", f"u{i}",
                    "s", ("en", "de", "fr")[i % 3]) for i, t in enumerate(lengths)]


def _same(ours: dict, theirs: dict) -> None:
    assert ours["features"].dtype == theirs["features"].dtype == torch.float32
    assert torch.equal(ours["features"], theirs["features"])  # padding values included
    assert ours["features"].is_contiguous()
    assert torch.equal(ours["lengths"], theirs["lengths"]) and ours["lengths"].device.type == "cpu"
    assert ours["texts"] == theirs["transcripts"] and ours["languages"] == theirs["languages"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_packed_batch_is_pad_examples_bit_for_bit(dtype):
    examples = _examples(dtype=dtype)
    packed = pack_examples(examples)
    assert len(packed) == len(examples) and packed.features.dtype == dtype
    for indices in ([0], [4, 1, 7], [8, 0, 3, 5, 2], list(range(9))[::-1]):
        _same(packed.batch(indices), pad_examples([examples[i] for i in indices]))


def test_non_finite_features_pad_as_pad_examples_does():
    examples = _examples(4)
    examples[2].features[1, 0] = float("nan")
    ours = pack_examples(examples).batch([2, 0])
    theirs = pad_examples([examples[2], examples[0]])
    assert torch.equal(ours["features"].isnan(), theirs["features"].isnan())
    keep = ~theirs["features"].isnan()
    assert torch.equal(ours["features"][keep], theirs["features"][keep])


def test_a_packed_client_is_still_the_sequence_of_its_examples():
    examples = _examples(5)
    packed = pack_examples(examples)
    assert len(packed) == 5 and [e.utterance_id for e in packed] == [e.utterance_id for e in examples]
    for mine, theirs in zip(packed[-2:], examples[-2:]):
        assert torch.equal(mine.features, theirs.features)
        assert (mine.transcript, mine.speaker, mine.language) == \
            (theirs.transcript, theirs.speaker, theirs.language)
    assert torch.equal(packed[0].features, examples[0].features)
    with pytest.raises(IndexError):
        packed[5]


def test_on_the_host_moving_is_a_no_op():
    packed = pack_examples(_examples(3))
    assert packed.to("cpu") is packed and packed.device.type == "cpu"
    assert packed.nbytes == packed.features.numel() * 2 + 3 * 4
    with pytest.raises(ValueError):
        packed.batch([])
    with pytest.raises(ValueError):
        pack_examples([])


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_make_batches_gives_the_batches_it_gave_before_from_a_list_or_packed(batch_size):
    from cluster_fl.engine.setup import make_batches

    examples = _examples(11, seed=3)
    for seed in (0, 1):
        before = list(old_batches(examples, batch_size, torch.Generator().manual_seed(seed)))
        for given in (examples, pack_examples(examples)):
            now = list(make_batches(given, batch_size, torch.Generator().manual_seed(seed)))
            assert len(now) == len(before)
            for a, b in zip(now, before):
                assert a["texts"] == b["texts"] and a["languages"] == b["languages"]
                assert torch.equal(a["features"], b["features"])
                assert torch.equal(a["lengths"], b["lengths"])
    assert list(make_batches([], 2, torch.Generator())) == []


def test_the_corpus_features_pack_and_pad_as_before(tiny_corpus, tmp_path):
    from cluster_fl.data.store import FeatureStore

    examples = FeatureStore(tiny_corpus, tmp_path, progress=False).split("test", ["en", "de"])
    assert all(e.features.dtype == torch.float16 for e in examples)
    packed = pack_examples(examples)
    for start in range(0, len(examples), 5):
        indices = list(range(start, min(start + 5, len(examples))))[::-1]
        _same(packed.batch(indices), pad_examples([examples[i] for i in indices]))

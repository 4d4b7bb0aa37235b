"""Where a run's client features live (``data.device_resident``, cluster_fl/engine/feeder.py):
the decision from sizes (fake ones: no GPU needed), the key's validation, and the feeder's blocks
on a CPU (the resident path's batches on device 'cpu' are the ones the engine made before)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cluster_fl.config import ConfigError, dump_config
from cluster_fl.engine.feeder import (RESIDENT_SHARE, ClientFeeder, estimate_feature_bytes,
                                      keep_resident)
from cluster_fl.errors import UserError
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")
GiB = 2**30


def test_auto_keeps_the_features_on_a_gpu_when_they_take_a_small_share_of_its_free_memory():
    free = 40 * GiB
    assert keep_resident("auto", GPU, int(RESIDENT_SHARE * free), free)
    assert not keep_resident("auto", GPU, int(RESIDENT_SHARE * free) + 1, free)
    assert not keep_resident("auto", GPU, 1, 0)  # nothing free: streamed


def test_true_insists_and_refuses_what_cannot_fit_false_streams_a_cpu_never_copies():
    assert keep_resident("true", GPU, 30 * GiB, 40 * GiB)  # past auto's share: asked for
    with pytest.raises(UserError, match=r"data.device_resident=true: .*50.00 GiB.*40.00 GiB"):
        keep_resident("true", GPU, 50 * GiB, 40 * GiB)
    assert not keep_resident("false", GPU, 1, 40 * GiB)
    for setting in ("auto", "true", "false"):
        assert not keep_resident(setting, CPU, 10**12, 0)


def test_a_bad_value_is_an_error_naming_the_key_and_the_allowed_values():
    with pytest.raises(UserError, match="data.device_resident: got 'yes'; allowed: auto, true"):
        keep_resident("yes", CPU, 0, 0)
    with pytest.raises(ConfigError, match="'data.device_resident'.*allowed: auto, true, false"):
        resolved_config(None, ["data.device_resident=always"])
    with pytest.raises(ConfigError, match="data.device_resident"):
        resolved_config(None, ["data.device_resident=1"])


def test_yaml_booleans_are_the_settings_and_survive_a_dump(tmp_path):
    assert resolved_config(None, []).data.device_resident == "auto"
    for given in ("true", "false", "auto"):
        cfg = resolved_config(None, [f"data.device_resident={given}"])
        assert cfg.data.device_resident == given
        path = tmp_path / f"{given}.yaml"
        path.write_text(dump_config(cfg))
        assert resolved_config(str(path), []).data.device_resident == given


def test_the_key_does_not_change_the_run_id():
    from cluster_fl.engine.rundir import run_id

    ids = {run_id(resolved_config(None, [f"data.device_resident={v}"])) for v in ("auto", "false")}
    assert len(ids) == 1


@dataclass
class _Utt:
    duration: float | None


@dataclass
class _Client:
    utterances: list


def test_feature_bytes_are_estimated_from_durations_before_anything_loads():
    clients = [_Client([_Utt(1.0), _Utt(2.505)]), _Client([_Utt(None)])]
    # 100 + 251 frames, and an unknown duration counted as 30 s (3000 frames); 80 bins x 2 bytes
    assert estimate_feature_bytes(clients, 80) == (100 + 251 + 3000) * 80 * 2


def test_the_feeder_packs_each_block_on_a_cpu_and_its_batches_are_the_old_ones(tiny_corpus):
    from engine_helpers import tiny_config
    from reference_batches import old_batches

    from cluster_fl.data.packed import PackedExamples
    from cluster_fl.engine.setup import load_clients, make_batches

    cfg = tiny_config(tiny_corpus, tiny_corpus.parent / "unused")
    _, clients, _ = load_clients(cfg)
    feeder = ClientFeeder.for_run(cfg.data.device_resident, CPU, clients, 80)
    assert not feeder.resident and feeder.describe() == ""
    blocks = [[0, 2], [1], [3, 4]]
    fed = list(feeder.blocks(clients, blocks))
    assert [[i for i, _ in b] for b in fed] == blocks
    for block in fed:
        for index, packed in block:
            assert isinstance(packed, PackedExamples) and packed.device.type == "cpu"
            examples = clients[index].load()
            assert len(packed) == len(examples)
            for seed in (0, 5):
                now = list(make_batches(packed, 2, torch.Generator().manual_seed(seed)))
                before = list(old_batches(examples, 2, torch.Generator().manual_seed(seed)))
                assert len(now) == len(before)
                for a, b in zip(now, before):
                    assert a["texts"] == b["texts"]
                    assert torch.equal(a["features"], b["features"])
                    assert torch.equal(a["lengths"], b["lengths"])
    assert feeder._kept == {}  # a CPU keeps nothing: the feature store holds them already

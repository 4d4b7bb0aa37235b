"""A real architecture in a sharded lane trains from its meta-device build:
two ranks forming one FSDP2 lane build the base as a skeleton and each load only its shard of the
local checkpoint (``setup.sharded_from_meta``), one unsharded rank loads it whole with
``from_pretrained``. Same clip decisions for every client of the round, the update within
float tolerance, the same epsilon -- the lane test of tests/engine/test_lanes.py, on the path a
9B decoder takes. Small stand-in checkpoints (``save_pretrained`` of a random Whisper / Llama and
a word-level tokenizer) play whisper-large-v3 and TinyLlama."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import decisions_worker, tiny_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_checkpoints import save_whisper_llama  # noqa: E402

from cluster_fl.distributed import spawn  # noqa: E402

# two ranks building and loading real (stand-in) checkpoints, ~25 s: `slow`, run by .ci/run after
# the default suite; tests/distributed/test_meta_build.py keeps the meta load in the default one
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(tiny_corpus, reference_run, tmp_path_factory):
    root = save_whisper_llama(tmp_path_factory.mktemp("hf"))
    return lambda name, *extra: tiny_overrides(
        tiny_corpus, tmp_path_factory.mktemp(name), "model.arch=whisper-tinyllama",
        f"model.encoder_path={root / 'whisper'}", f"model.decoder_path={root / 'llama'}",
        "model.lora_rank=2", "privacy.clipping=flat", "fl.rounds=1",
        "model.dtype=float32", *extra)  # float32: the 1e-5 tolerance below is float32's


def test_a_meta_built_fsdp2_lane_of_a_real_architecture_trains_like_one_rank(real):
    from cluster_fl.config import load_config
    from cluster_fl.distributed.parallelize import LaneLayout
    from cluster_fl.engine.setup import sharded_from_meta

    lane_overrides = real("lane", "model.shard=fsdp2", "model.shard_group_size=2")
    assert sharded_from_meta(load_config(None, lane_overrides), LaneLayout(2, 2, 0))
    one = spawn(decisions_worker, 1, real("one"), use_fake=True, timeout_s=300)
    lane = spawn(decisions_worker, 2, lane_overrides, timeout_s=300)
    a, b = one[0]["decisions"], lane[0]["decisions"]
    assert a.keys() == b.keys() and len(a) >= 3
    assert [v[:2] for _, v in sorted(a.items())] == [v[:2] for _, v in sorted(b.items())]
    for key in a:
        assert math.isclose(a[key][2], b[key][2], rel_tol=1e-5), key
    sa, sb = one[0]["state"], lane[0]["state"]
    delta = max(float((sa[k] - sb[k]).abs().max() / (sa[k].abs().max() + 1e-12)) for k in sa)
    assert delta < 1e-4
    assert [r["epsilon"] for r in one[0]["rows"]] == [r["epsilon"] for r in lane[0]["rows"]]
    assert all(v.dtype == torch.float32 for v in sb.values())

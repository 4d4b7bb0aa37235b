"""Meta-device build for sharded lanes: with ``model.shard_group_size`` > 1
no rank holds the whole frozen base. A real architecture is built as a skeleton on the meta
device; FSDP2 allocates each rank's shards and reads only their rows from the safetensors
checkpoint (DeepSpeed was removed, ARCHITECTURE.md). Against a whole ``from_pretrained``
build: the same base (gathered), the same trainable init (LoRA, new connector), the same
buffers, bit for bit. Small stand-in checkpoints (``save_pretrained`` of random Whisper / Llama /
Voxtral) play the real ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_checkpoints import from_pretrained_model, save_voxtral, save_whisper_llama  # noqa: E402

from cluster_fl.config import ModelConfig  # noqa: E402
from cluster_fl.distributed import spawn  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    save_whisper_llama(root)
    save_voxtral(root / "vox")
    return root


def _cfg(root: Path, arch: str, **kw) -> ModelConfig:
    if arch == "voxtral":
        return ModelConfig(arch=arch, decoder_path=str(root / "vox"), lora_rank=2, **kw)
    return ModelConfig(arch=arch, encoder_path=str(root / "whisper"),
                       decoder_path=str(root / "llama"), lora_rank=2, **kw)


def _state(model) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({"buffer:" + n: b.detach().clone() for n, b in model.named_buffers()})
    return out


@pytest.mark.parametrize("arch", ["whisper-tinyllama", "voxtral"])
def test_a_skeleton_read_whole_is_the_from_pretrained_model(checkpoints, arch):
    from cluster_fl.distributed.parallelize import parallelize
    from cluster_fl.models import build_model

    cfg = _cfg(checkpoints, arch, dtype="bfloat16")
    model = from_pretrained_model(cfg, seed=3)  # Hugging Face's own loader: the reference
    parallelize(model, cfg, torch.device("cpu"))  # the dtype policy: base bf16, trainable fp32
    whole = _state(model)
    torch.manual_seed(3)
    host = build_model(cfg)  # read onto the host by the lean loader
    parallelize(host, cfg, torch.device("cpu"))
    on_host = _state(host)
    assert [k for k in whole if not torch.equal(whole[k], on_host[k])] == []
    torch.manual_seed(3)
    skeleton = build_model(cfg, meta=True)
    frozen = [n for n, p in skeleton.named_parameters() if not p.requires_grad]
    assert frozen and all(p.is_meta for n, p in skeleton.named_parameters() if n in frozen)
    assert not any(p.is_meta for p in skeleton.parameters() if p.requires_grad)
    parallelize(skeleton, cfg, torch.device("cpu"))  # unsharded: the skeleton is read whole
    read = _state(skeleton)
    assert whole.keys() == read.keys()
    assert [k for k in whole if not torch.equal(whole[k], read[k])] == []
    assert any(v.dtype == torch.bfloat16 for v in read.values())


def lane_worker(comm, root: Path, arch: str, shard: str) -> dict:
    """One member of a lane of ``comm.world_size``: build from meta, shard, load; report the
    gathered state, the rows read per tensor and the share of the base held locally."""
    from torch.distributed.tensor import DTensor

    from cluster_fl.distributed.parallelize import LaneLayout, parallelize
    from cluster_fl.models import build_model
    from cluster_fl.models.weights import CheckpointWeights

    reads: dict[str, int] = {}
    original, original_into = CheckpointWeights.read, CheckpointWeights.read_into

    def read(self, name, start=None, stop=None):
        out = original(self, name, start, stop)
        reads[name] = reads.get(name, 0) + (out.shape[0] if out.dim() else 1)
        return out

    def read_into(self, name, out, start=0):
        original_into(self, name, out, start)
        reads[name] = reads.get(name, 0) + (out.shape[0] if out.dim() else 1)

    CheckpointWeights.read, CheckpointWeights.read_into = read, read_into
    g = comm.world_size
    cfg = _cfg(root, arch, shard=shard, shard_group_size=g)
    torch.manual_seed(3)
    model = build_model(cfg, meta=True)
    parallelize(model, cfg, torch.device("cpu"), LaneLayout(g, g, comm.rank))
    state, local, total = {}, 0, 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            total += p.numel()
        state[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    state.update({"buffer:" + n: b.detach().clone() for n, b in model.named_buffers()})
    return {"state": state, "reads": reads, "local_share": local / total}


# (Voxtral's key layout is read by the test above; one spawned lane of each kind is enough)
@pytest.mark.parametrize("arch,shard", [("whisper-tinyllama", "fsdp2")])
def test_a_lane_of_two_loads_only_its_shards_and_equals_a_whole_build(checkpoints, arch, shard):
    from cluster_fl.distributed.parallelize import LaneLayout, parallelize

    cfg = _cfg(checkpoints, arch)
    whole = from_pretrained_model(cfg, seed=3)
    parallelize(whole, cfg, torch.device("cpu"), LaneLayout(1, 1, 0))
    want = _state(whole)
    sizes = {n: p.shape[0] for n, p in whole.named_parameters() if not p.requires_grad}
    lane = spawn(lane_worker, 2, checkpoints, arch, shard, timeout_s=240)
    for member in lane:
        got = member["state"]
        assert got.keys() == want.keys()
        assert [k for k in want if not torch.equal(want[k], got[k])] == []
        assert member["local_share"] < 0.6  # each rank read its own rows, no more
        read = member["reads"]
        assert all(read.get(n, 0) <= -(-rows // 2) for n, rows in sizes.items())
    for n, rows in sizes.items():  # together the members read every row exactly once
        assert lane[0]["reads"].get(n, 0) + lane[1]["reads"].get(n, 0) == rows, n

def test_a_checkpoint_that_does_not_match_its_config_is_refused_before_loading(checkpoints,
                                                                               tmp_path):
    import json
    import shutil

    from cluster_fl.errors import UserError
    from cluster_fl.models import build_model

    llama = tmp_path / "llama"
    shutil.copytree(checkpoints / "llama", llama)
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    bad = ModelConfig(arch="whisper-tinyllama", encoder_path=str(checkpoints / "whisper"),
                      decoder_path=str(llama), lora_rank=2)
    with pytest.raises(UserError, match=r"mlp.*shape \[128, 64\].*\[96, 64\]"):
        build_model(bad, meta=True)

"""model.connector_init=fresh: a pretrained checkpoint with a new connector (the first study's starting
point) -- only the connector moves, one seed gives one init, the init follows the run's seed
unless model.connector_seed pins it, and misuse is refused."""

from __future__ import annotations

import pytest
import torch

from cluster_fl.config import ModelConfig
from cluster_fl.errors import UserError
from cluster_fl.models import REGISTRY, build_base, build_model, save_checkpoint
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

TINY = [name for name, spec in REGISTRY.items() if spec.tiny]


@pytest.fixture(params=TINY)
def pretrained(request, tmp_path):
    torch.manual_seed(0)
    base = build_base(ModelConfig(arch=request.param))
    save_checkpoint(base, base.tokenizer, tmp_path / "pre")
    return request.param, tmp_path / "pre", {k: v.clone() for k, v in base.state_dict().items()}


def _base_state(model):
    """Base weights by their pretrain names (LoRA wraps q/k/v as ``base_layer``)."""
    return {k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
            if "lora_" not in k}


def test_fresh_moves_the_connector_and_nothing_else(pretrained):
    arch, path, saved = pretrained
    kept = _base_state(build_model(ModelConfig(arch=arch, checkpoint=str(path))))
    fresh = _base_state(build_model(ModelConfig(arch=arch, checkpoint=str(path),
                                                connector_init="fresh"), run_seed=0))
    connector = [k for k in saved if k.startswith("connector.")]
    assert connector, "the tiny archs have a connector with weights"
    for k, v in saved.items():
        assert torch.equal(kept[k], v), k
        if k in connector:
            assert not torch.equal(fresh[k], v), f"{k} kept its pretrained value"
        else:
            assert torch.equal(fresh[k], v), f"{k} moved with the connector"


def test_one_seed_one_init_and_the_global_rng_is_untouched(pretrained):
    arch, path, _ = pretrained

    def connector(seed):
        torch.manual_seed(99)
        model = build_model(ModelConfig(arch=arch, checkpoint=str(path), connector_init="fresh",
                                        connector_seed=seed))
        after = torch.rand(1)
        torch.manual_seed(99)
        build_model(ModelConfig(arch=arch, checkpoint=str(path)))
        assert torch.equal(after, torch.rand(1)), "the re-init consumed the global RNG"
        return {k: v for k, v in model.state_dict().items() if k.startswith("connector.")}

    a, b, c = connector(0), connector(0), connector(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def _connector(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.startswith("connector.")}


def test_the_fresh_connector_follows_the_run_seed_unless_pinned(pretrained):
    """Seeds of a study start from different connectors (round-0 differs per seed); seed 0 is
    the connector the first study used for every seed (connector_seed 0)."""
    arch, path, _ = pretrained
    cfg = ModelConfig(arch=arch, checkpoint=str(path), connector_init="fresh")
    assert cfg.connector_seed is None
    s0, s0b, s1 = (_connector(build_model(cfg, run_seed=s)) for s in (0, 0, 1))
    assert all(torch.equal(s0[k], s0b[k]) for k in s0)
    assert not any(torch.equal(s0[k], s1[k]) for k in s0 if k.endswith("weight"))
    pinned = ModelConfig(arch=arch, checkpoint=str(path), connector_init="fresh", connector_seed=0)
    old = _connector(build_model(pinned, run_seed=1))
    assert all(torch.equal(s0[k], old[k]) for k in s0)  # pinned: the same init for every seed
    secure = _connector(build_model(cfg, run_seed=None))  # secure mode has no seed: 0
    assert all(torch.equal(s0[k], secure[k]) for k in s0)


def test_misuse_is_refused(pretrained, tmp_path):
    arch, path, _ = pretrained
    with pytest.raises(UserError, match="model.connector_init"):
        ModelConfig(arch=arch, connector_init="fresh")  # nothing to keep: no checkpoint
    with pytest.raises(UserError, match="model.connector_init"):
        ModelConfig(arch=arch, checkpoint=str(path), connector_init="new")
    federated = build_model(ModelConfig(arch=arch, checkpoint=str(path)))
    save_checkpoint(federated, federated.tokenizer, tmp_path / "fed")
    with pytest.raises(UserError, match="federated checkpoint"):
        build_model(ModelConfig(arch=arch, checkpoint=str(tmp_path / "fed"),
                                connector_init="fresh"))


def test_the_default_leaves_run_ids_alone():
    from cluster_fl.engine.rundir import run_id

    default = resolved_config(None)
    assert default.model.connector_init == "checkpoint"
    # the id runs had before connector_init existed (their base dtype, float32, pinned)
    old = resolved_config(None, ["model.dtype=float32", "eval.max_new_tokens=64"])  # and limit
    assert run_id(old) == "whisper-tinyllama-tiny_unfrozen_alpha-split_s0_6c0e30c8"
    fresh = resolved_config(None, ["model.checkpoint=/x", "model.connector_init=fresh"])
    assert run_id(fresh) != run_id(resolved_config(None, ["model.checkpoint=/x"]))
    # a seed given without a fresh connector seeds nothing and changes no id
    assert resolved_config(None, ["model.connector_seed=5"]).model.connector_seed is None
    assert run_id(resolved_config(None, ["model.connector_seed=5"])) == run_id(default)

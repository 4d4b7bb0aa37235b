"""The step written for speed computes what the PEFT-based step computed.

* :class:`LoRALinear` is PEFT's LoRA layer: same parameter names, the same initial values from
  the same seed (the same random draws in the same order), the same output;
* a prepared step padded to buckets gives each utterance the loss it has unpadded;
* K learners stacked in one forward give each learner its own output.
"""

from __future__ import annotations

import pytest
import torch

from cluster_fl.config import ModelConfig
from cluster_fl.models import build_model, get_trainable, set_trainable, trainable_parameters
from cluster_fl.models.lora import LoRALinear, stacked_trainables


def _peft_model(cfg: ModelConfig):
    """The tiny model with PEFT's own LoRA injection (what apply_lora did before)."""
    from peft import LoraConfig, inject_adapter_in_model

    from cluster_fl.models import build_base
    from cluster_fl.models.lora import lora_pattern

    model = build_base(cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                       target_modules=lora_pattern(cfg.freeze_encoder),
                                       bias="none"), model, adapter_name="default")
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.startswith("connector."))
    return model


def test_lora_linear_has_pefts_names_init_and_output(batch):
    pytest.importorskip("peft")
    cfg = ModelConfig(dtype="float32")
    torch.manual_seed(0)
    ours = build_model(cfg)
    torch.manual_seed(0)
    theirs = _peft_model(cfg)
    mine, peft = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert list(mine) == list(peft)
    for name in mine:
        assert torch.equal(mine[name], peft[name]), name  # same draws, same order
    assert any(isinstance(m, LoRALinear) for m in ours.modules())
    g = torch.Generator().manual_seed(1)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in get_trainable(ours).items()}
    set_trainable(ours, moved)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            key = name.replace(".default.weight", "")
            if key in moved:
                p.copy_(moved[key])
    assert torch.allclose(ours.loss(batch)[0], theirs.loss(batch)[0], rtol=1e-5, atol=1e-6)


def test_a_bucketed_step_gives_each_utterance_its_unpadded_loss(batch):
    torch.manual_seed(0)
    model = build_model(ModelConfig(dtype="float32")).eval()
    exact = model.row_loss_sums(model.prepare(batch))
    padded = model.prepare(batch, (64, 16, 32))
    assert padded.features.shape[-1] % 64 == 0 and padded.ids.shape[1] % 16 == 0
    assert padded.target_ids.numel() % 32 == 0
    assert torch.allclose(model.row_loss_sums(padded), exact, rtol=1e-4, atol=1e-5)
    assert padded.n_tokens.tolist() == [len(t) + 1 for t in batch.texts]


def test_stacked_learners_each_get_their_own_output(batch):
    torch.manual_seed(0)
    model = build_model(ModelConfig(dtype="float32")).eval()
    params = trainable_parameters(model)
    g = torch.Generator().manual_seed(2)
    learners = [{k: v.detach() + 0.05 * torch.randn(v.shape, generator=g) for k, v in params.items()}
                for _ in range(2)]
    alone = []
    for values in learners:
        set_trainable(model, values)
        alone.append(model.row_losses(batch)[0])
    stacks = {k: torch.stack([values[k] for values in learners]) for k in params}
    rows = len(batch.texts)
    both = {"features": torch.cat([batch.features, batch.features]),
            "lengths": torch.cat([batch.lengths, batch.lengths]),
            "texts": batch.texts * 2, "languages": batch.languages * 2}
    with stacked_trainables(model, stacks):
        sums, _ = model.row_losses(both)
    assert torch.allclose(sums[:rows], alone[0], rtol=1e-4, atol=1e-5)
    assert torch.allclose(sums[rows:], alone[1], rtol=1e-4, atol=1e-5)
    assert all(m.stack is None for m in model.modules() if isinstance(m, LoRALinear))

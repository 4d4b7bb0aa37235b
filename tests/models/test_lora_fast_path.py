"""The step written for speed computes what the PEFT-based step computed.

* :class:`LoRALinear` is PEFT's LoRA layer: same parameter names, the same initial values from
  the same seed (the same random draws in the same order), the same output;
* a prepared step padded to buckets gives each utterance the loss it has unpadded;
* K learners stacked in one forward give each learner its own output;
* an attention block's q/k/v sharing one LoRA down-projection (``share_qkv_input``) give each layer
  its own output and gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cluster_fl.config import ModelConfig
from cluster_fl.models import build_model, get_trainable, set_trainable, trainable_parameters
from cluster_fl.models.lora import LoRALinear, share_qkv_input, stacked_trainables


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


def _moved(model, seed: int = 3) -> None:
    """Trainables off their init (LoRA's B starts at zero, which would hide a wrong B)."""
    g = torch.Generator().manual_seed(seed)
    set_trainable(model, {k: v + 0.05 * torch.randn(v.shape, generator=g)
                          for k, v in get_trainable(model).items()})


def test_shared_qkv_terms_give_each_layer_its_own_output_and_gradient(batch):
    torch.manual_seed(0)
    apart = build_model(ModelConfig(dtype="float32"))
    _moved(apart)
    shared = copy.deepcopy(apart)
    assert shared.share_qkv_input() == 6  # 3 encoder + 3 decoder attention blocks
    losses = []
    for model in (apart, shared):
        loss, _ = model.loss(batch)
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=1e-7)
    grads = {n: p.grad for n, p in shared.named_parameters() if p.requires_grad}
    for name, p in apart.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, grads[name], rtol=1e-5, atol=1e-7), name
    # every block released what it held once v had its columns
    assert all(m.shared._input is None for m in shared.modules()
               if isinstance(m, LoRALinear) and m.shared is not None)


def test_a_shared_layer_given_another_input_computes_its_own_terms():
    torch.manual_seed(0)
    apart = build_model(ModelConfig(dtype="float32"))
    _moved(apart)
    shared = copy.deepcopy(apart)
    share_qkv_input(shared)
    a, s = apart.decoder.model.layers[1].self_attn, shared.decoder.model.layers[1].self_attn
    x, y = torch.randn(2, 5, 192), torch.randn(2, 5, 192)
    with torch.no_grad():
        assert torch.equal(s.q_proj(x), a.q_proj(x))
        assert torch.equal(s.k_proj(y), a.k_proj(y))  # not q's input: not q's terms
        assert torch.equal(s.v_proj(x), a.v_proj(x))
        assert torch.equal(s.k_proj(x), a.k_proj(x))  # out of order, alone


def test_only_blocks_whose_three_layers_match_are_shared():
    frozen = build_model(ModelConfig(dtype="float32", freeze_encoder=True))
    assert share_qkv_input(frozen) == 3  # no encoder LoRA: decoder blocks only
    dropped = build_model(ModelConfig(dtype="float32", lora_dropout=0.1))
    assert share_qkv_input(dropped) == 0  # PEFT draws a dropout mask per layer


def test_shared_qkv_under_activation_checkpointing_gives_the_same_gradients(batch):
    # a GPU run compiles and recomputes its layers: the recomputation calls q, k, v again
    from cluster_fl.dist.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    apart = build_model(ModelConfig(dtype="float32"))
    _moved(apart)
    shared = copy.deepcopy(apart)
    share_qkv_input(shared)
    assert apply_activation_checkpointing(shared) == 6
    for model in (apart, shared):
        model.loss(batch)[0].backward()
    grads = {n: p.grad for n, p in shared.named_parameters() if p.requires_grad}
    for name, p in apart.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)

"""Each tiny architecture trains, groups its LoRA by component, and round-trips checkpoints."""

from __future__ import annotations

import pytest
import torch

from cluster_fl.config import ModelConfig
from cluster_fl.models import (REGISTRY, build_base, build_model, collate, describe_groups,
                               get_trainable, greedy_decode, load_checkpoint, save_checkpoint,
                               set_trainable, trainable_groups,
                               trainable_parameters)

TINY = [name for name, spec in REGISTRY.items() if spec.tiny]


def _perturbed(model, scale: float = 0.05, seed: int = 1):
    """LoRA B starts at zero; move every group so LoRA actually changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    set_trainable(model, {k: v + scale * torch.randn(v.shape, generator=g)
                          for k, v in get_trainable(model).items()})
    return model


@pytest.mark.parametrize("arch", TINY)
def test_forward_backward_reaches_every_trainable_group(arch, batch):
    torch.manual_seed(0)
    model = _perturbed(build_model(ModelConfig(arch=arch)))
    loss, n_tokens = model.loss(batch)
    assert torch.isfinite(loss) and n_tokens == sum(len(t) + 1 for t in batch.texts)
    loss.backward()
    params = dict(model.named_parameters())
    for name, p in params.items():
        trainable = ".lora_" in name or name.startswith("connector.")
        assert p.requires_grad == trainable, name
        if trainable:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("arch", TINY)
def test_lora_groups_are_labelled_by_component(arch):
    model = build_model(ModelConfig(arch=arch))
    groups = trainable_groups(model)
    spec = REGISTRY[arch]
    n_enc, n_dec = spec.encoder["encoder_layers"], spec.decoder["num_hidden_layers"]
    comps = [g.component for g in groups]
    assert comps.count("encoder") == 6 * n_enc  # q/k/v x (A, B) per layer
    assert comps.count("decoder") == 6 * n_dec
    assert comps.count("connector") >= 1
    modules = dict(model.named_modules())
    for g in groups:
        owner = modules[g.name.rsplit(".", 1)[0]] if g.component != "connector" else None
        if g.component == "encoder":  # inside the audio tower, never the LM (Voxtral too)
            assert any(owner is m for m in model.encoder.modules()), g.name
        elif g.component == "decoder":
            assert any(owner is m for m in model.decoder.modules()), g.name
        p = dict(model.named_parameters())
        assert g.numel == sum(v.numel() for k, v in p.items() if k.startswith(g.name + ".")
                              or k == g.name)
    assert [g.name for g in groups] == [g.name for g in trainable_groups(build_model(
        ModelConfig(arch=arch)))], "group order must be stable"


@pytest.mark.parametrize("arch", TINY)
def test_frozen_encoder_has_no_encoder_groups(arch, batch):
    model = build_model(ModelConfig(arch=arch, freeze_encoder=True))
    groups = trainable_groups(model)
    assert groups and all(g.component != "encoder" for g in groups)
    assert not any(".lora_" in n for n, _ in model.encoder.named_parameters())
    assert all(not p.requires_grad for p in model.encoder.parameters())
    model.loss(batch)[0].backward()


@pytest.mark.parametrize("arch", TINY)
def test_describe_groups_matches_the_built_model(arch):
    for freeze in (False, True):
        cfg = ModelConfig(arch=arch, freeze_encoder=freeze, lora_rank=2)
        assert describe_groups(cfg) == trainable_groups(build_model(cfg))


@pytest.mark.parametrize("arch,expected", [("whisper-tinyllama", 32 * 6 + 22 * 6 + 2),
                                           ("whisper-eurollm", 32 * 6 + 24 * 6 + 2),
                                           ("voxtral", 32 * 6 + 30 * 6 + 2)])
def test_real_architectures_are_described_on_meta_without_weights(arch, expected):
    groups = describe_groups(ModelConfig(arch=arch, lora_rank=16))
    assert len(groups) == expected
    q_a = next(g for g in groups if g.name.startswith("decoder.") and "q_proj.lora_A" in g.name)
    hidden = REGISTRY[arch].decoder["hidden_size"]
    assert q_a.numel == 16 * hidden
    frozen = describe_groups(ModelConfig(arch=arch, lora_rank=16, freeze_encoder=True))
    assert len(frozen) == expected - 32 * 6


@pytest.mark.parametrize("arch", TINY)
def test_save_load_round_trip_gives_same_outputs(arch, batch, tmp_path):
    torch.manual_seed(0)
    model = _perturbed(build_model(ModelConfig(arch=arch, freeze_encoder=arch == "voxtral-tiny")))
    model.eval()
    save_checkpoint(model, model.tokenizer, tmp_path / "ck")
    again = load_checkpoint(tmp_path / "ck").eval()
    with torch.no_grad():
        assert torch.equal(model.loss(batch)[0], again.loss(batch)[0])
    assert greedy_decode(model, batch, 8) == greedy_decode(again, batch, 8)
    assert [g.name for g in trainable_groups(again)] == [g.name for g in trainable_groups(model)]
    for k, v in get_trainable(model).items():
        assert torch.equal(v, get_trainable(again)[k])


def test_build_model_starts_from_a_pretrain_checkpoint(batch, tmp_path):
    torch.manual_seed(0)
    base = build_base(ModelConfig())
    save_checkpoint(base, base.tokenizer, tmp_path / "pre")
    torch.manual_seed(123)  # a different random init must not leak in
    model = build_model(ModelConfig(checkpoint=str(tmp_path / "pre"))).eval()
    with torch.no_grad():  # LoRA B = 0 at start, so outputs equal the pretrained base
        assert torch.allclose(model.loss(batch)[0], base.eval().loss(batch)[0], atol=1e-6)


def test_set_trainable_changes_outputs_and_rejects_unknown_groups(batch):
    torch.manual_seed(0)
    model = build_model(ModelConfig()).eval()
    before = model.loss(batch)[0].item()
    _perturbed(model, scale=0.5)
    assert model.loss(batch)[0].item() != pytest.approx(before, abs=1e-6)
    with pytest.raises(KeyError):
        set_trainable(model, {"nope": torch.zeros(1)})
    live = trainable_parameters(model)  # the same tensors the optimiser updates in place
    assert list(live) == [g.name for g in trainable_groups(model)]
    with torch.no_grad():
        next(iter(live.values())).add_(1.0)
    name = next(iter(live))
    assert torch.equal(get_trainable(model)[name], live[name])


def test_padded_batch_matches_each_utterance_alone(utterances):
    torch.manual_seed(0)
    model = build_base(ModelConfig()).eval()
    items = utterances[:3]
    full = collate([u.features for u in items], [u.transcript for u in items])
    audio, n_audio, _, _ = model.audio_embeddings(full.features, full.lengths)
    for i, u in enumerate(items):
        one = collate([u.features], [u.transcript])
        alone, n_one, _, _ = model.audio_embeddings(one.features, one.lengths)
        assert int(n_one[0]) == int(n_audio[i])
        assert torch.allclose(alone[0], audio[i, : int(n_one[0])], atol=1e-5)
    hyps_batched = greedy_decode(model, full, 6)
    hyps_single = [greedy_decode(model, collate([u.features], [u.transcript],
                                                [u.language]), 6)[0] for u in items]
    full_lang = collate([u.features for u in items], [u.transcript for u in items],
                        [u.language for u in items])
    assert greedy_decode(model, full_lang, 6) == hyps_single
    assert len(hyps_batched) == len(items)


def test_data_package_batches_are_accepted_as_they_come(utterances):
    from cluster_fl.data import pad_examples

    torch.manual_seed(0)
    model = build_model(ModelConfig()).eval()
    items = utterances[:3]
    ours = collate([u.features for u in items], [u.transcript for u in items],
                   [u.language for u in items])
    theirs = pad_examples(items)  # pads with each example's minimum, not zero
    with torch.no_grad():
        assert torch.allclose(model.loss(theirs)[0], model.loss(ours)[0], atol=1e-5)
    assert greedy_decode(model, theirs, 6) == greedy_decode(model, ours, 6)


def _reference_decoder_inputs(model, audio, n_audio, texts, languages):
    """Per-utterance assembly (the layout the batched gathers must reproduce)."""
    from cluster_fl.models.speech_llm import IGNORE

    tok, seqs, targets = model.tokenizer, [], []
    table = model.decoder.get_input_embeddings()
    for i, (text, lang) in enumerate(zip(texts, languages)):
        prompt, body = tok.prompt_ids(lang), tok.encode(text)
        ids = prompt + body + [tok.eos_id]
        n = int(n_audio[i])
        seqs.append(torch.cat([audio[i, :n], table(torch.tensor(ids[:-1]))]))
        targets.append([IGNORE] * (n + len(prompt) - 1) + body + [tok.eos_id])
    length = max(len(t) for t in targets)
    emb = torch.zeros(len(seqs), length, audio.shape[-1])
    attn = torch.zeros(len(seqs), length, dtype=torch.long)
    tgt = torch.full((len(seqs), length), IGNORE, dtype=torch.long)
    for i, (s, t) in enumerate(zip(seqs, targets)):
        emb[i, : len(t)], attn[i, : len(t)], tgt[i, : len(t)] = s, 1, torch.tensor(t)
    return emb, attn, tgt


@pytest.mark.parametrize("arch", ["whisper-tinyllama-tiny", "voxtral-tiny"])
def test_batched_decoder_inputs_match_per_utterance_assembly(arch):
    torch.manual_seed(0)
    model = build_base(ModelConfig(arch=arch))
    d = model.decoder.config.hidden_size
    audio = torch.randn(3, 7, d)
    n_audio = torch.tensor([7, 2, 5])
    texts, langs = ["hello world", "a", "zwölf dreißig"], ["en", None, "de"]
    from cluster_fl.models.speech_llm import Buckets, StepInputs, _decoder_layout

    tok = model.tokenizer
    layout = _decoder_layout(n_audio.tolist(), audio.shape[1], [tok.prompt_ids(g) for g in langs],
                             [tok.encode(t) for t in texts], tok.pad_id, tok.eos_id, Buckets())
    length = layout.pop("length")
    cos, sin = model._rotary_table(length)
    step = StepInputs(features=None, encoder=None, cos=cos, sin=sin, **layout)
    emb = model.decoder_embeddings(audio, step)
    tgt = torch.full((3 * length,), -100, dtype=torch.long)
    tgt[step.target_index] = step.target_ids
    want = _reference_decoder_inputs(model, audio, n_audio, texts, langs)
    assert emb.shape == want[0].shape and torch.equal(emb, want[0])
    assert torch.equal(step.valid[..., 0].long(), want[1])
    assert torch.equal(tgt.view(3, length), want[2])


def test_tiny_variants_use_eager_attention():
    for arch in ("whisper-tinyllama-tiny", "whisper-eurollm-tiny", "voxtral-tiny"):
        model = build_base(ModelConfig(arch=arch))
        assert model.encoder.config._attn_implementation == "eager", arch
        assert model.decoder.model.config._attn_implementation == "eager", arch


def test_ctc_loss_alone_runs_only_the_encoder(batch):
    torch.manual_seed(0)
    model = build_base(ModelConfig())
    loss = model.ctc_loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert all(p.grad is None for p in model.decoder.parameters())
    assert all(p.grad is None for p in model.connector.parameters())
    assert model.ctc_head.weight.grad is not None

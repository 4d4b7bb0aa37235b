"""The character tokenizer covers the corpus vocabulary; a short pretraining run lowers the loss."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster_fl.config import ModelConfig
from cluster_fl.data.vocab import LANGUAGES, NUMBERS, WORDS
from cluster_fl.errors import UserError
from cluster_fl.models import CharTokenizer, build_base, load_checkpoint, load_tokenizer
from cluster_fl.training.pretrain import batch_order, pretrain, split_heldout, train
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

REPO = Path(__file__).resolve().parents[2]


def test_char_tokenizer_covers_every_corpus_word_and_round_trips(tmp_path):
    tok = CharTokenizer()
    for lang in LANGUAGES:
        for word in WORDS[lang] + NUMBERS[lang]:
            ids = tok.encode(word)
            assert tok.unk_id not in ids, (lang, word)
            assert tok.decode(ids) == word
        assert len(tok.prompt_ids(lang)) == 2  # bos + language tag
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.symbols == tok.symbols and again.encode("żółć dwa") == tok.encode("żółć dwa")
    assert tok.decode([tok.bos_id, *tok.encode("a b"), tok.eos_id]) == "a b"


def test_heldout_split_is_speaker_disjoint_and_per_language(make_examples):
    ex = make_examples(16)
    train_set, held = split_heldout(ex, 1, seed=0)
    assert {e.speaker for e in train_set}.isdisjoint({e.speaker for e in held})
    assert sorted({e.language for e in held}) == sorted({e.language for e in ex})
    assert split_heldout(ex, 1, seed=0)[1] == held  # deterministic


def test_batch_order_covers_each_example_once():
    order = batch_order([5, 1, 9, 3, 7, 2, 8], 3, np.random.default_rng(0))
    assert sorted(i for b in order for i in b) == list(range(7))


def test_short_pretraining_lowers_the_loss(utterances):
    torch.manual_seed(0)
    model = build_base(ModelConfig())
    ex = utterances[:8]
    result = train(model, ex, lr=3e-3, batch_size=4, ctc_weight=0.5, steps=30, seed=0,
                   log=lambda s: None)
    losses = result["losses"]
    assert result["step"] == 30
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_pretrain_command_saves_a_checkpoint_and_reuses_it(tmp_path, tiny_corpus):
    cfg = resolved_config(None, [f"pretrain.out={tmp_path / 'pre'}", "pretrain.steps=3",
                             f"data.corpus={tiny_corpus}", "data.languages=[en, de, fr]",
                             f"data.feature_cache={tmp_path / 'features'}",
                             "pretrain.minutes=0", "pretrain.heldout_speakers=1",
                             "pretrain.eval_every=0", "pretrain.batch_size=4",
                             "eval.max_new_tokens=4"])
    logs: list[str] = []
    first = pretrain(cfg, log=logs.append)  # reads the public split through the data package
    assert first["step"] == 3 and not first["cached"] and 0.0 <= first["wer"]
    model = load_checkpoint(tmp_path / "pre")
    assert model.ctc_head is not None
    second = pretrain(cfg, log=logs.append)
    assert second["cached"] and second["step"] == 3
    with pytest.raises(Exception, match="pretrain"):
        resolved_config(None, ["pretrain.steps=0", "pretrain.minutes=0"])


def _capped_clock(monkeypatch, seconds_per_call: float = 1.0) -> None:
    """pretrain's clock advances ``seconds_per_call`` at every reading, so a minutes cap stops a
    run at a step that depends on the code alone, not on this machine's speed."""
    import itertools
    import types

    import cluster_fl.training.pretrain as module

    ticks = itertools.count()
    clock = types.SimpleNamespace(monotonic=lambda: seconds_per_call * next(ticks))
    monkeypatch.setattr(module, "time", clock)  # this module's clock only


def _weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path / "model.pt", weights_only=True)


def test_a_minutes_cap_that_cuts_a_step_budget_fails_and_the_resume_finishes_it(
        tmp_path, tiny_corpus, monkeypatch):
    """The cap stops the run early: the command fails loudly (the unfinished checkpoint is no
    starting model), a second call resumes, and the result is bitwise that of one uninterrupted
    run of the same budget."""
    import json

    base = ["pretrain.eval_every=0", "pretrain.heldout_speakers=1", "pretrain.batch_size=4",
            "pretrain.eval_utterances=3", "pretrain.steps=5", "pretrain.ctc_warmstart=0.4",
            f"data.corpus={tiny_corpus}", "data.languages=[en, de, fr]",
            f"data.feature_cache={tmp_path / 'features'}", "eval.max_new_tokens=2"]
    pretrain(resolved_config(None, base + [f"pretrain.out={tmp_path / 'whole'}", "pretrain.minutes=0"]),
             log=lambda s: None)
    _capped_clock(monkeypatch)  # one reading per step: a cap of 3 s stops after 2 steps
    capped = base + [f"pretrain.out={tmp_path / 'cut'}", f"pretrain.minutes={3 / 60}"]
    with pytest.raises(UserError, match="cap .* ran out at step 2 of the pretrain.steps budget 5"):
        pretrain(resolved_config(None, capped), log=lambda s: None)
    assert json.loads((tmp_path / "cut" / "meta.json").read_text())["done"] is False
    monkeypatch.undo()
    logs: list[str] = []
    # the cap is no part of the recipe under a step budget: lifting it resumes the same run
    result = pretrain(resolved_config(None, base + [f"pretrain.out={tmp_path / 'cut'}",
                                                "pretrain.minutes=0"]), log=logs.append)
    assert any("resuming from step 2" in line for line in logs) and result["step"] == 5
    whole, cut = _weights(tmp_path / "whole"), _weights(tmp_path / "cut")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)


def test_a_checkpoint_of_another_recipe_is_not_reused_or_resumed(tmp_path, tiny_corpus):
    base = [f"pretrain.out={tmp_path / 'pre'}", "pretrain.minutes=0", "pretrain.eval_every=0",
            "pretrain.heldout_speakers=1", "pretrain.batch_size=4", "pretrain.eval_utterances=3",
            f"data.corpus={tiny_corpus}", "data.languages=[en, de, fr]",
            f"data.feature_cache={tmp_path / 'features'}", "eval.max_new_tokens=2"]
    pretrain(resolved_config(None, base + ["pretrain.steps=2"]), log=lambda s: None)
    with pytest.raises(UserError, match=r"another recipe: .*pretrain.steps \(2 there, 4 here\)"):
        pretrain(resolved_config(None, base + ["pretrain.steps=4"]), log=lambda s: None)
    with pytest.raises(UserError, match=r"seed \(0 there, 1 here\)"):
        pretrain(resolved_config(None, base + ["pretrain.steps=2", "run.seed=1"]), log=lambda s: None)
    # where evaluations go and how many: not the recipe
    again = pretrain(resolved_config(None, base + ["pretrain.steps=2", "pretrain.eval_utterances=2"]),
                     log=lambda s: None)
    assert again["cached"]
    assert pretrain(resolved_config(None, base + ["pretrain.steps=4"]), force=True,
                    log=lambda s: None)["step"] == 4


@pytest.mark.parametrize("warmstart", [0.0, 0.5])
def test_two_step_budgeted_pretrains_from_scratch_give_identical_checkpoints(
        tmp_path, tiny_corpus, warmstart):
    """The starting model is rebuilt exactly: the same step budget and seed, run twice from
    scratch (one of them evaluating and checkpointing every step), give bitwise equal weights;
    another seed does not."""
    base = ["pretrain.minutes=0", "pretrain.heldout_speakers=1", "pretrain.batch_size=4",
            "pretrain.eval_utterances=3", "pretrain.steps=6", f"pretrain.ctc_warmstart={warmstart}",
            f"data.corpus={tiny_corpus}", "data.languages=[en, de, fr]",
            f"data.feature_cache={tmp_path / 'features'}", "eval.max_new_tokens=2"]
    for name, extra in (("a", ["pretrain.eval_every=0"]), ("b", ["pretrain.eval_every=1"]),
                        ("c", ["pretrain.eval_every=0", "run.seed=1"])):
        pretrain(resolved_config(None, base + extra + [f"pretrain.out={tmp_path / name}"]),
                 log=lambda s: None)
    a, b, c = (_weights(tmp_path / n) for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_cli_pretrain_runs_and_bad_keys_exit_2(tmp_path, tiny_corpus, capsys):
    from cluster_fl.cli import main

    args = ["pretrain", str(REPO / "configs" / "pretrain.yaml"), f"pretrain.out={tmp_path / 'p'}",
            "pretrain.steps=1", "pretrain.minutes=0", "pretrain.heldout_speakers=1",
            "pretrain.eval_utterances=2", "eval.max_new_tokens=2", "run.threads=1",
            f"data.corpus={tiny_corpus}", "data.languages=[en, de, fr]",
            f"data.feature_cache={tmp_path / 'f'}"]
    assert main(args) == 0
    assert (tmp_path / "p" / "model.pt").is_file() and "checkpoint:" in capsys.readouterr().out
    assert main(args + ["pretrain.lr=-1"]) == 2
    assert "pretrain.lr" in capsys.readouterr().err


def _snapshot(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _changed(module: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    return any(not torch.equal(p, q) for p, q in zip(module.parameters(), before))


def test_ctc_warmstart_trains_only_the_encoder_then_everything(utterances):
    torch.manual_seed(0)
    model = build_base(ModelConfig())
    ex = utterances[:8]
    enc, dec, conn = _snapshot(model.encoder), _snapshot(model.decoder), _snapshot(model.connector)
    logs: list[str] = []
    first = train(model, ex, lr=3e-3, batch_size=4, ctc_weight=0.5, steps=3, seed=0,
                  ctc_warmstart=0.9, log=logs.append)
    assert first["joint_start"] is None  # steps 0, 1, 2 all fall in the first 90%
    assert _changed(model.encoder, enc)
    assert not _changed(model.decoder, dec) and not _changed(model.connector, conn)

    torch.manual_seed(0)
    model = build_base(ModelConfig())
    dec = _snapshot(model.decoder)
    seen: list[tuple[int, int | None]] = []
    second = train(model, ex, lr=3e-3, batch_size=4, ctc_weight=0.5, steps=6, seed=0,
                   ctc_warmstart=0.5, eval_every=1, on_eval=lambda s, e, j: seen.append((s, j)),
                   log=logs.append)
    assert second["joint_start"] == 3 and _changed(model.decoder, dec)
    assert seen == [(1, None), (2, None), (3, None), (4, 3), (5, 3), (6, 3)]
    with pytest.raises(ValueError, match="ctc_warmstart"):
        train(model, ex, lr=1e-3, batch_size=4, ctc_weight=0.5, steps=1, ctc_warmstart=1.0)


def test_phase_learning_rate_rewarms_for_the_joint_phase():
    from cluster_fl.training.pretrain import _phase_lr_factor

    warm = 10
    ctc = [_phase_lr_factor(s, s / 100, warm, 0.3, None) for s in range(30)]
    assert ctc[0] == pytest.approx(0.1) and ctc[9] == 1.0 and set(ctc[10:]) == {1.0}
    joint = [_phase_lr_factor(30 + s, (30 + s) / 100, warm, 0.3, 30) for s in range(70)]
    assert joint[0] == pytest.approx(0.1) and joint[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(joint[9:], joint[10:]))  # cosine decay after warm-up
    assert _phase_lr_factor(100, 1.0, warm, 0.3, 30) == pytest.approx(0.1)
    # without a warm-start the schedule is the single-phase one
    assert _phase_lr_factor(50, 0.5, warm, 0.0, 0) == pytest.approx(0.55)
    # the decay ends at the configured floor (pretrain.final_lr)
    assert _phase_lr_factor(100, 1.0, warm, 0.3, 30, final=0.0) == pytest.approx(0.0, abs=1e-12)
    assert _phase_lr_factor(50, 0.5, warm, 0.0, 0, final=0.0) == pytest.approx(0.5)


def test_pretraining_resumes_inside_the_ctc_warmstart(tmp_path, tiny_corpus, monkeypatch):
    base = [f"pretrain.out={tmp_path / 'pre'}", "pretrain.eval_every=1",
            "pretrain.heldout_speakers=1", "pretrain.batch_size=4", "pretrain.eval_utterances=3",
            "pretrain.ctc_warmstart=0.5", "pretrain.steps=4", f"data.corpus={tiny_corpus}",
            "data.languages=[en, de, fr]", f"data.feature_cache={tmp_path / 'features'}",
            "eval.max_new_tokens=2"]
    logs: list[str] = []
    # a clock that advances 1 s a reading, cap 3 s: stopped after step 1, inside the warm-start
    # (steps 0 and 1 of 4)
    _capped_clock(monkeypatch)
    with pytest.raises(UserError, match="ran out at step 1 "):
        pretrain(resolved_config(None, base + [f"pretrain.minutes={3 / 60}"]), log=logs.append)
    monkeypatch.undo()
    state = torch.load(tmp_path / "pre" / "train_state.pt", weights_only=False)
    assert state["joint_start"] is None and state["step"] == 1
    assert not any("held-out WER" in line and "step      1" in line for line in logs)
    result = pretrain(resolved_config(None, base + ["pretrain.minutes=0"]), log=logs.append)
    assert result["step"] == 4
    assert torch.load(tmp_path / "pre" / "train_state.pt", weights_only=False)["joint_start"] == 2
    with pytest.raises(Exception, match="ctc_warmstart"):
        resolved_config(None, ["pretrain.ctc_warmstart=1"])


def test_separate_pretraining_trains_the_encoder_then_the_decoder_never_the_connector(utterances):
    """mode separate: CTC on the encoder, then the decoder alone as a text LM; the connector keeps
    its init and the encoder does not move in the LM phase."""
    torch.manual_seed(0)
    model = build_base(ModelConfig())
    ex = utterances[:8]
    conn, dec = _snapshot(model.connector), _snapshot(model.decoder)
    train(model, ex, lr=3e-3, batch_size=4, ctc_weight=0.5, steps=3, seed=0, ctc_warmstart=0.9,
          separate=True, log=lambda s: None)
    assert not _changed(model.decoder, dec)
    enc = _snapshot(model.encoder)
    logs: list[str] = []
    out = train(model, ex, lr=3e-3, batch_size=4, ctc_weight=0.5, steps=40, seed=0,
                ctc_warmstart=0.5, separate=True, log=logs.append)
    assert out["joint_start"] == 20 and _changed(model.decoder, dec)
    assert not _changed(model.connector, conn)
    assert any("decoder alone" in line for line in logs)
    lm = out["losses"][20:]
    assert np.mean(lm[-5:]) < 0.8 * np.mean(lm[:5])  # the LM learns the transcripts
    # the LM phase computes no encoder gradient: the encoder moved only in the CTC phase
    enc_after_ctc = _snapshot(model.encoder)
    train(model, ex, lr=3e-3, batch_size=4, ctc_weight=0.5, steps=2, seed=0, ctc_warmstart=0.0,
          separate=True, joint_start=0, log=lambda s: None)
    assert not _changed(model.encoder, enc_after_ctc) and _changed(model.encoder, enc)


def test_text_loss_matches_the_speech_loss_without_audio_tokens(utterances):
    """The LM objective is the speech-LLM's transcript loss with zero audio tokens: the same
    targets and positions (checked through a connector that outputs nothing)."""
    torch.manual_seed(0)
    model = build_base(ModelConfig()).eval()
    texts = [u.transcript for u in utterances[:3]]
    langs = [u.language for u in utterances[:3]]
    lm = model.text_loss(texts, langs)
    step = model.prepare_text(texts, langs)
    assert int(step.valid.sum()) == sum(len(model.tokenizer.prompt_ids(g)) +
                                        len(model.tokenizer.encode(t)) for t, g in zip(texts, langs))
    assert int((step.target_ids != -100).sum()) == sum(model.target_counts(texts))
    assert torch.isfinite(lm) and float(lm.detach()) > 0


def test_ctc_transcribe_merges_repeats_and_drops_blanks(utterances):
    torch.manual_seed(0)
    model = build_base(ModelConfig()).eval()
    tok = model.tokenizer
    target = tok.encode("ab ba")
    frames = [tok.pad_id, target[0], target[0], tok.pad_id, target[1], target[2], target[2],
              target[3], tok.pad_id, target[3], target[4]]  # a a _ b ' ' ' ' b _ b a

    class Path(torch.nn.Module):
        def forward(self, states):
            n = states.shape[1]
            logits = torch.full((states.shape[0], n, len(tok.symbols)), -1.0)
            for i in range(n):
                logits[:, i, frames[i] if i < len(frames) else tok.pad_id] = 1.0
            return logits

    model.ctc_head = Path()
    batch = {"features": [utterances[0].features], "texts": ["x"], "languages": ["en"]}
    assert model.ctc_transcribe(batch) == ["ab bba"]


def test_separate_mode_needs_its_encoder_share_and_is_not_mixed_with_joint(tmp_path, tiny_corpus):
    with pytest.raises(Exception, match="ctc_warmstart"):
        resolved_config(None, ["pretrain.mode=separate", "pretrain.ctc_warmstart=0"])
    with pytest.raises(Exception, match="pretrain.mode"):
        resolved_config(None, ["pretrain.mode=apart"])
    base = [f"pretrain.out={tmp_path / 'pre'}", "pretrain.minutes=0", "pretrain.eval_every=0",
            "pretrain.heldout_speakers=1", "pretrain.batch_size=4", "pretrain.eval_utterances=3",
            "pretrain.steps=2", f"data.corpus={tiny_corpus}", "data.languages=[en, de, fr]",
            f"data.feature_cache={tmp_path / 'features'}", "eval.max_new_tokens=2"]
    logs: list[str] = []
    result = pretrain(resolved_config(None, base + ["pretrain.mode=separate"]), log=logs.append)
    assert 0.0 <= result["wer"] and any("CTC (encoder) WER" in line for line in logs)
    meta = json.loads((tmp_path / "pre" / "meta.json").read_text())
    assert meta["mode"] == "separate" and meta["wer_kind"] == "encoder CTC greedy"
    with pytest.raises(Exception, match="pretrain.mode=separate"):
        pretrain(resolved_config(None, base), log=lambda s: None)


def test_the_demo_and_study_pretrains_are_budgeted_in_steps():
    """A starting model that does not depend on the machine's speed: the demo's and the study's
    pretraining configs give a step budget and no wall-clock budget."""
    for path in (REPO / "configs" / "pretrain.yaml", REPO / "configs" / "pretrain-repro.yaml",
                 REPO / "cluster_fl" / "assets" / "demo.yaml",
                 REPO / "cluster_fl" / "assets" / "demo-heavy.yaml"):
        pc = resolved_config(path).pretrain
        assert pc.steps > 0 and pc.minutes == 0, path

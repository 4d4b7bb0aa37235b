"""Presets are code: every architecture in ``configs/arch/`` and every cell of
every grid in ``configs/grids/`` is built at its real widths, heads, vocabulary and mel bins --
the depth cut to one encoder and one decoder layer -- trains one client step and decodes one
utterance, on CPU. The files are enumerated, so a new preset is covered without editing this test,
and one that cannot take a step fails it.

What stands in for what this machine does not have:

* weights: random (:class:`~cluster_fl.models.weights.RandomWeights`), through the meta-device
  build a sharded lane uses (``build_model(meta=True)``) and the unsharded materialisation of
  ``distributed.parallelize``;
* the real tokenizer: a word-level Hugging Face tokenizer of the decoder's real vocabulary size,
  saved to a temporary folder and loaded by the production adapter (``model.tokenizer_path``);
* a ``model.checkpoint`` of a tiny variant (the study's pretrained starting points): the same
  architecture at random init (same shapes);
* audio: a second of a tone, featurised with the resolved ``data.n_mels`` -- the check that
  features and the encoder's first convolution agree.

Grid cells that differ only in what does not change shapes or the step's code path (method,
seed, privacy, schedule) are built once: :func:`shape_key`. Sharded presets run unsharded here
(the lane tests cover sharding); the dtype and activation checkpointing are the preset's.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ARCH_FILES = sorted((ROOT / "configs" / "arch").glob("*.yaml"))
GRID_FILES = sorted((ROOT / "configs" / "grids").glob("*.yaml"))
DEPTH = (1, 1)  # encoder layers, decoder layers
SHAPE_KEYS = ("arch", "freeze_encoder", "lora_rank", "dtype", "activation_checkpointing",
              "pad_to_window")
TIMES: dict[str, float] = {}


def _configs() -> dict[str, tuple[list[str], object]]:
    """shape key -> (the presets and grid cells it stands for, one resolved config of them)."""
    from cluster_fl.config import load_config
    from cluster_fl.sweep.gridspec import expand, load_grid
    from cluster_fl.models.registry import resolve_shapes

    found: dict[str, tuple[list[str], object]] = {}

    def add(name: str, cfg) -> None:
        cfg = resolve_shapes(cfg)
        key = shape_key(cfg)
        found.setdefault(key, ([], cfg))[0].append(name)

    for path in ARCH_FILES:
        add(f"arch/{path.name}", load_config(path))
    for path in GRID_FILES:
        for spec in expand(load_grid(path)):
            add(f"grids/{path.name}:{spec.cell}", spec.config)
    return found


def shape_key(cfg) -> str:
    """What changes the shapes or the step's code path: the architecture, LoRA placement and
    rank, mel bins, dtype and checkpointing (not the method, seed or schedule)."""
    m = cfg.model
    return "-".join(str(getattr(m, k)) for k in SHAPE_KEYS) + f"-mels{cfg.data.n_mels}"


CONFIGS = _configs()


def test_every_preset_file_and_grid_cell_is_covered():
    covered = {name.split(":")[0] for names, _ in CONFIGS.values() for name in names}
    assert covered == {f"arch/{p.name}" for p in ARCH_FILES} | {f"grids/{p.name}"
                                                                 for p in GRID_FILES}
    # the paper grid's cells collapse to arch x frozen/unfrozen
    paper = [k for k, (names, _) in CONFIGS.items() if any("paper.yaml" in n for n in names)]
    assert len(paper) == 6


def _stand_in_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level HF tokenizer with exactly ``vocab_size`` entries (the decoder's real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "Transcribe", "Transcribe:", "(en):", "hello",
             "world"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(str(folder))
    return folder


def _example(n_mels: int, seconds: float = 1.0):
    from cluster_fl.data.features import SAMPLE_RATE, Example, log_mel

    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    audio = 0.3 * np.sin(2 * np.pi * 440 * t) * np.exp(-t)
    feats = log_mel(audio.astype(np.float32), n_mels=n_mels).to(torch.float16)
    return Example(feats, "hello world", "u0", "s0", "en")


# the two slowest shape keys (~15-20 s each on this CPU) are `slow`, run by .ci/run's slow stage:
# the 9B decoder, and Voxtral with its encoder frozen (the frozen-encoder path runs by default
# on both Whisper pairs, Voxtral's own widths with its encoder trained)
SLOW_KEYS = ("whisper-eurollm-9b-", "voxtral-True-")


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow)
                                 if k.startswith(SLOW_KEYS) else k for k in sorted(CONFIGS)])
def test_a_preset_at_real_widths_takes_a_client_step_and_decodes(key, tmp_path):
    from cluster_fl.config import override
    from cluster_fl.distributed.parallelize import parallelize
    from cluster_fl.engine.client import ClientRunner
    from cluster_fl.engine.setup import make_batches
    from cluster_fl.models import (build_model, get_arch, get_trainable, greedy_decode,
                                   trainable_groups, trainable_parameters)
    from cluster_fl.models.weights import RandomWeights

    names, cfg = CONFIGS[key]
    t0 = time.perf_counter()
    spec = get_arch(cfg.model.arch)
    changes = {"model.checkpoint": None, "model.connector_init": "checkpoint",
               "model.shard": "none", "model.shard_group_size": 1, "fl.batch_size": 1,
               "fl.max_local_steps": 1, "fl.local_epochs": 1, "fl.clients_per_step": 1,
               "run.device": "cpu"}
    if not spec.tiny:  # nothing of the real checkpoints is here: stand-ins of the same shapes
        tokenizer = _stand_in_tokenizer(tmp_path / "tokenizer", spec.decoder["vocab_size"])
        changes.update({"model.encoder_path": None, "model.decoder_path": None,
                        "model.tokenizer_path": str(tokenizer)})
    cfg = override(cfg, changes)
    torch.manual_seed(0)
    model = build_model(cfg.model, meta=not spec.tiny, weights=RandomWeights(0), depth=DEPTH)
    placement = parallelize(model, cfg.model, torch.device("cpu"))  # the preset's dtype policy
    enc = model.encoder.config
    assert model.encoder.conv1.in_channels == cfg.data.n_mels == spec.n_mels
    assert len(model.encoder.layers) == 1 and len(model.decoder.model.layers) == 1
    widths = (enc.d_model if hasattr(enc, "d_model") else enc.hidden_size,
              model.decoder.config.hidden_size)
    want = spec.encoder.get("d_model", spec.encoder.get("hidden_size")), spec.decoder["hidden_size"]
    assert widths == want
    assert model.decoder.get_input_embeddings().num_embeddings == (
        len(model.tokenizer) if spec.tiny else spec.decoder["vocab_size"])
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    assert frozen == {placement.dtype}

    groups = trainable_groups(model)
    runner = ClientRunner(model, trainable_parameters(model), groups, cfg.fl, cfg.client,
                          make_batches, cfg.run.seed or 0, placement)
    example = _example(cfg.data.n_mels)
    update = runner.train(0, [example, example], get_trainable(model), 1)
    assert update.steps == 1 and np.isfinite(update.loss)
    assert all(torch.isfinite(d).all() for d in update.delta.values())
    assert any(float(d.abs().max()) > 0 for d in update.delta.values())
    with placement.compute():
        texts = greedy_decode(model, {"features": [example.features.float()],
                                      "texts": [example.transcript], "languages": ["en"]}, 2)
    assert len(texts) == 1 and isinstance(texts[0], str)
    TIMES[key] = time.perf_counter() - t0
    print(f"\n{key}: {TIMES[key]:.1f} s for {len(names)} preset(s)/cell(s): "
          + ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""))
    del model, runner, placement
    gc.collect()


def test_the_smoke_keys_see_what_changes_shapes():
    from cluster_fl.config import load_config

    base = load_config(ROOT / "configs" / "arch" / "whisper-tinyllama.yaml")
    from cluster_fl.models.registry import resolve_shapes

    a = shape_key(resolve_shapes(base))
    assert shape_key(resolve_shapes(dataclasses.replace(
        base, model=dataclasses.replace(base.model, freeze_encoder=True)))) != a
    assert shape_key(resolve_shapes(dataclasses.replace(
        base, privacy=dataclasses.replace(base.privacy, clipping="flat")))) == a
    assert shape_key(resolve_shapes(dataclasses.replace(
        base, model=dataclasses.replace(base.model, pad_to_window=True)))) != a

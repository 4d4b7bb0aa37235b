"""Model checkpoints: a directory with ``model.pt`` (state dict), ``meta.json`` (architecture and
LoRA settings) and the tokenizer, written atomically (temp dir + rename) so a crash never leaves a
half-written checkpoint where a reader expects a whole one.

``build_model`` is the entry point the engine uses: base model (random init, pretrained weights,
or a pretrain checkpoint) then LoRA.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from cluster_fl.config import ModelConfig
from cluster_fl.errors import UserError
from cluster_fl.models.build import build_base, init_new_weights
from cluster_fl.models.lora import apply_lora
from cluster_fl.models.registry import get_arch
from cluster_fl.models.speech_llm import SpeechLLM
from cluster_fl.models.tokenizer import Tokenizer, load_tokenizer

FORMAT = 1


def save_checkpoint(model: SpeechLLM, tokenizer: Tokenizer | None, directory: str | Path,
                    extra: dict | None = None) -> Path:
    """Write model weights, meta and tokenizer to ``directory`` atomically (replacing it)."""
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        torch.save(state, tmp / "model.pt")
        meta = {"format": FORMAT, "arch": model.arch, "lora": getattr(model, "lora", None),
                "has_ctc": model.ctc_head is not None, **(extra or {})}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        (tokenizer or model.tokenizer).save(tmp / "tokenizer")
        if target.exists():  # swap: old out of the way first, so the rename is atomic
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_meta(directory: str | Path) -> dict:
    """``meta.json`` of a checkpoint (UserError when the directory is not one)."""
    path = Path(directory).expanduser() / "meta.json"
    if not path.is_file():
        raise UserError(f"{directory} is not a model checkpoint (no meta.json)")
    return json.loads(path.read_text())


def load_checkpoint(directory: str | Path, model_cfg: ModelConfig | None = None) -> SpeechLLM:
    """Rebuild the model a checkpoint describes (LoRA included when it has it) and load it."""
    directory = Path(directory).expanduser()
    meta = read_meta(directory)
    tokenizer = load_tokenizer(directory / "tokenizer")
    cfg = model_cfg or ModelConfig(arch=meta["arch"])
    if cfg.arch != meta["arch"]:
        raise UserError(f"model.checkpoint {directory} holds arch {meta['arch']!r}, "
                        f"config asks for {cfg.arch!r}")
    model = build_base(cfg, tokenizer)
    if meta.get("lora"):
        lora = meta["lora"]
        apply_lora(model, ModelConfig(arch=cfg.arch, lora_rank=lora["rank"],
                                      lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                      freeze_encoder=lora["freeze_encoder"]))
    state = torch.load(directory / "model.pt", map_location="cpu", weights_only=True)
    if not meta.get("has_ctc", True):
        model.ctc_head = None
    model.load_state_dict(state, strict=True)
    return model


def reinit_connector(model: SpeechLLM, seed: int) -> None:
    """Give every layer of the connector PyTorch's default init, drawn from ``seed`` alone (the
    global RNG is left as it was)."""
    layers = [m for m in model.connector.modules() if hasattr(m, "reset_parameters")]
    if not layers:
        raise UserError(f"{model.arch}: the connector has no layer to re-initialise")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in layers:
            m.reset_parameters()


def connector_seed(model_cfg: ModelConfig, run_seed: int | None) -> int:
    """The seed of a ``fresh`` connector: ``model.connector_seed`` when set, else the run's seed
    (0 for a secure-mode run, which has none: its replicates share the init, as they share the
    LoRA init)."""
    if model_cfg.connector_seed is not None:
        return model_cfg.connector_seed
    return 0 if run_seed is None else int(run_seed)


def build_model(model_cfg: ModelConfig, tokenizer: Tokenizer | None = None, *,
                meta: bool = False, weights: Any = None,
                depth: tuple[int, int] | None = None, run_seed: int | None = None,
                storage_dtype: torch.dtype | None = None) -> SpeechLLM:
    """The model a run trains (:func:`_build_model`), its encoder input padded to the encoder's
    window or not as ``model.pad_to_window`` says (:meth:`SpeechLLM.encode`); ``storage_dtype``:
    see :func:`~cluster_fl.models.build.build_base`."""
    model = _build_model(model_cfg, tokenizer, meta=meta, weights=weights, depth=depth,
                         run_seed=run_seed, storage_dtype=storage_dtype)
    model.pad_to_window = bool(getattr(model_cfg, "pad_to_window", False))
    return model


def _build_model(model_cfg: ModelConfig, tokenizer: Tokenizer | None = None, *,
                 meta: bool = False, weights: Any = None,
                 depth: tuple[int, int] | None = None, run_seed: int | None = None,
                 storage_dtype: torch.dtype | None = None) -> SpeechLLM:
    """The model a run trains: base (``model.checkpoint`` when given) plus LoRA from the config.

    A checkpoint that already carries LoRA (a federated checkpoint) must match the config's
    rank and encoder freezing; it is returned as saved. ``run_seed`` (``run.seed``) seeds a
    ``fresh`` connector unless ``model.connector_seed`` pins it (:func:`connector_seed`).

    Real architectures: the weights no checkpoint holds (LoRA, the stacking connector) come from
    one seed drawn from the global RNG before anything is built (:func:`init_new_weights`), so
    ``meta=True`` -- the frozen base left on the meta device for a sharded lane to load shard by
    shard, the trainable weights on the CPU -- starts from the values of a whole build.
    ``weights`` and ``depth``: see :func:`~cluster_fl.models.build.build_base`.
    """
    if model_cfg.checkpoint is None:
        if get_arch(model_cfg.arch).tiny and model_cfg.init == "pretrained":
            raise UserError(f"model.init=pretrained: {model_cfg.arch} is built from random "
                            "weights unless model.checkpoint names a `cluster-fl pretrain` "
                            "checkpoint; set it (or model.init=auto)")
        if get_arch(model_cfg.arch).tiny:
            return apply_lora(build_base(model_cfg, tokenizer, depth=depth), model_cfg)
        seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        model = apply_lora(build_base(model_cfg, tokenizer, meta=meta, weights=weights,
                                      depth=depth, storage_dtype=storage_dtype), model_cfg)
        init_new_weights(model, seed)
        return model
    meta = read_meta(model_cfg.checkpoint)
    model = load_checkpoint(model_cfg.checkpoint, model_cfg)
    lora = meta.get("lora")
    if model_cfg.connector_init == "fresh" and lora is not None:
        raise UserError(f"model.connector_init=fresh: {model_cfg.checkpoint} is a federated "
                        "checkpoint (it carries LoRA); start from a pretrained one")
    if model_cfg.connector_init == "fresh":
        reinit_connector(model, connector_seed(model_cfg, run_seed))
    if lora is None:
        return apply_lora(model, model_cfg)
    if (lora["rank"], lora["freeze_encoder"]) != (model_cfg.lora_rank, model_cfg.freeze_encoder):
        raise UserError(f"model.checkpoint {model_cfg.checkpoint} has LoRA rank {lora['rank']} / "
                        f"freeze_encoder {lora['freeze_encoder']}; the config asks for "
                        f"{model_cfg.lora_rank} / {model_cfg.freeze_encoder}")
    return model

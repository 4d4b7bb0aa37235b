"""What a run trained, in formats other tools load (``cluster-fl export RUN OUT``).

From a finished (or checkpointed) run folder it writes:

* ``decoder-adapter/``: the decoder's LoRA as a PEFT adapter (``adapter_config.json`` +
  ``adapter_model.safetensors``): ``PeftModel.from_pretrained(base_decoder, OUT/decoder-adapter)``
  gives the logits the run's decoder gives (tests/engine/test_export.py);
* ``encoder-lora.safetensors`` (an unfrozen encoder's LoRA A/B, by our group names) and
  ``connector.safetensors`` (the connector, trained fully);
* ``base/decoder`` and ``base/encoder`` in Hugging Face format (``save_pretrained``) when the
  run's base is not a Hugging Face checkpoint on disk (the embedded default and every model
  built from ``model.checkpoint`` or at random); otherwise the adapter names the
  checkpoint it was trained on (``model.decoder_path``);
* ``README.md``: a model card whose figures -- ε, δ, the guarantee's state, the neighbouring
  relation, clipping, σ, rounds, data and WER -- are read from the run folder.

The weights are the last checkpoint's (after round r of R: the card says which).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from cluster_fl.config import Config, to_dict
from cluster_fl.engine.checkpoint import load_run_checkpoint
from cluster_fl.engine.metrics import read_rows
from cluster_fl.errors import UserError
from cluster_fl.seeding import derive_seed

ADAPTER_DIR = "decoder-adapter"
# PEFT's target modules: exactly the decoder's q/k/v that models/lora.py adapts
DECODER_TARGETS = r".*model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)"


def trained_model(folder: Path, cfg: Config) -> tuple[Any, dict[str, Any]]:
    """(the run's model with its last checkpoint's trainable state, that checkpoint)."""
    from cluster_fl.models import build_model, set_trainable

    ckpt = load_run_checkpoint(Path(folder), rounds=cfg.fl.rounds)
    if ckpt is None:
        raise UserError(f"{folder} holds no checkpoint: nothing was trained yet")
    if cfg.seed is None and cfg.model.checkpoint is None and cfg.model.decoder_path is None:
        raise UserError("a secure-mode run on a random base cannot be exported: its base was "
                        "drawn from a seed that is not kept")
    torch.manual_seed(derive_seed(cfg.seed, "init"))  # as the run built it (engine/setup.py)
    model = build_model(cfg.model, run_seed=cfg.seed)
    set_trainable(model, {k: v.float() for k, v in ckpt["state"].items()})
    return model.eval(), ckpt


def clean_decoder(model: Any) -> Any:
    """The run's decoder without LoRA, as the plain Hugging Face model it was built from."""
    from transformers import AutoModelForCausalLM

    return _without_lora(model.decoder, AutoModelForCausalLM.from_config(model.decoder.config))


def clean_encoder(model: Any) -> Any:
    """The run's encoder without LoRA (its Hugging Face class, e.g. ``WhisperEncoder``)."""
    return _without_lora(model.encoder, type(model.encoder)(model.encoder.config))


def _without_lora(module: Any, plain: Any) -> Any:
    """``plain`` (a fresh module of the same architecture) holding ``module``'s base weights."""
    state = {k.replace(".base_layer.", "."): v for k, v in module.state_dict().items()
             if ".lora_" not in k}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise UserError(f"export: the decoder's weights do not map onto "
                        f"{type(plain).__name__} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return plain.eval()


def decoder_adapter(model: Any, base: Any, base_path: str) -> Any:
    """A PEFT model on ``base`` whose LoRA weights are the run's decoder LoRA."""
    from peft import LoraConfig, get_peft_model

    lora = model.lora
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=DECODER_TARGETS, bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=base_path)
    base.name_or_path = base_path  # PEFT records the base it finds on the model
    peft_model = get_peft_model(base, config)
    ours = dict(model.named_parameters())
    with torch.no_grad():
        copied = 0
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(ours["decoder." + name.removeprefix("base_model.model.")])
                copied += 1
    expected = sum(1 for n in ours if n.startswith("decoder.") and ".lora_" in n)
    if copied != expected:
        raise UserError(f"export: {copied} of the decoder's {expected} LoRA matrices mapped")
    return peft_model


def save_tensors(path: Path, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path))


def export_run(folder: Path, out: Path, cfg: Config) -> list[Path]:
    """Write the export of run ``folder`` (whose recorded config, resolved, is ``cfg``) under
    ``out`` (module docstring); the paths written."""
    folder, out = Path(folder), Path(out)
    model, ckpt = trained_model(folder, cfg)
    if not hasattr(model, "decoder") or not re.search(r"whisper", cfg.model.arch):
        raise UserError(f"export supports the whisper-llama architectures, not {cfg.model.arch}")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    on_disk = cfg.model.checkpoint is None and cfg.model.decoder_path is not None
    base = clean_decoder(model)
    if on_disk:
        base_path = str(cfg.model.decoder_path)
    else:
        base_path = str((out / "base" / "decoder").resolve())
        base.save_pretrained(out / "base" / "decoder")
        clean_encoder(model).save_pretrained(out / "base" / "encoder")
        written += [out / "base" / "decoder", out / "base" / "encoder"]
    adapter = decoder_adapter(model, base, base_path)
    adapter.save_pretrained(out / ADAPTER_DIR)
    written.append(out / ADAPTER_DIR)
    state = {k: v for k, v in ckpt["state"].items()}
    encoder = {k: v for k, v in state.items() if k.startswith("encoder.")}
    if encoder:
        save_tensors(out / "encoder-lora.safetensors", encoder)
        written.append(out / "encoder-lora.safetensors")
    save_tensors(out / "connector.safetensors",
                 {k: v for k, v in state.items() if k.startswith("connector.")})
    written.append(out / "connector.safetensors")
    (out / "README.md").write_text(model_card(folder, cfg, ckpt["round"], base_path, on_disk))
    written.append(out / "README.md")
    return written


def neighbouring(privacy: dict[str, Any]) -> str:
    """The neighbouring relation the accountant used (one client = one speaker)."""
    if privacy.get("neighbouring_relation"):
        return str(privacy["neighbouring_relation"])
    if privacy.get("sampling") == "fixed":
        return "replace one client (fixed-size cohorts)"
    return "add or remove one client (Poisson sampling)"


def model_card(folder: Path, cfg: Config, round_: int, base_path: str, on_disk: bool) -> str:
    """The export's README.md: every figure read from the run folder."""
    privacy_path = folder / "privacy.json"
    privacy = json.loads(privacy_path.read_text()) if privacy_path.is_file() else {}
    final = (read_rows(folder / "final.parquet") or [{}])[-1]
    rounds = cfg.fl.rounds
    eps = privacy.get("epsilon")
    eps_s = "∞ (no finite bound)" if eps is None else f"{eps:.4g}"
    mech = privacy.get("mechanism", cfg.privacy.mechanism)
    lines = [
        f"# {folder.name}",
        "",
        f"LoRA adapters of a speech-LLM ({cfg.model.arch}: Whisper encoder -> connector -> Llama "
        f"decoder) fine-tuned with federated learning by `cluster_fl`, exported from the run "
        f"folder `{folder.name}` after round {round_} of {rounds}.",
        "",
        "## Files",
        "",
        f"- `{ADAPTER_DIR}/`: the decoder's LoRA as a PEFT adapter; load it with "
        "`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "
        f"\"{ADAPTER_DIR}\")`, BASE = "
        + (f"`{base_path}` (the checkpoint the run trained on)" if on_disk else
           "`base/decoder` (written here: the run's base is not a Hugging Face checkpoint)"),
        "- `encoder-lora.safetensors`: the encoder's LoRA A/B (absent for a frozen encoder)",
        "- `connector.safetensors`: the frame-stacking connector (trained fully)",
        "",
        "## Privacy",
        "",
        "| | |", "|---|---|",
        f"| mechanism | {mech} |",
        f"| ε | {eps_s} |",
        f"| δ | {privacy.get('delta', cfg.privacy.delta)} |",
        f"| guarantee | {privacy.get('guarantee', 'none')}: {privacy.get('guarantee_note', '')} |",
        f"| neighbouring relation | {neighbouring(privacy)} (one client = one speaker) |",
        f"| accountant | {privacy.get('accountant', '')} |",
        f"| clipping | {privacy.get('clipping', cfg.privacy.clipping)}, C = "
        f"{privacy.get('clip_norm', cfg.privacy.clip_norm)} |",
        f"| noise multiplier σ | {privacy.get('noise_multiplier', cfg.privacy.noise_multiplier)} |",
        f"| sampling | {privacy.get('sampling', cfg.fl.sampling)}, q = "
        f"{privacy.get('sampling_rate', '')} of {privacy.get('population', '')} clients |",
        f"| rounds | {privacy.get('rounds', rounds)} |",
        f"| secure mode | {privacy.get('secure_mode', cfg.privacy.secure_mode)} |",
    ]
    for pool in privacy.get("pools") or []:
        lines.append(f"| pool {pool.get('name')} | share {pool.get('alpha', pool.get('share', ''))}, "
                     f"effective σ {pool.get('effective_noise_multiplier', '')} |")
    lines += [
        "",
        "## Data",
        "",
        f"- corpus `{Path(str(cfg.data.corpus)).name}`, languages {', '.join(cfg.data.languages)}; "
        f"clients are speakers, {cfg.fl.clients_per_round} per round",
    ]
    if final.get("wer") is not None:
        ci = ""
        if final.get("wer_ci_low") is not None:
            ci = f" (95% CI {final['wer_ci_low']:.4f} to {final['wer_ci_high']:.4f}, speaker-clustered)"
        lines.append(f"- test WER {final['wer']:.4f}{ci}")
    lines += ["", "## Config", "", "```json", json.dumps(to_dict(cfg), indent=1, default=str), "```", ""]
    return "\n".join(lines)

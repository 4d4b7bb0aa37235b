"""Small random Hugging Face checkpoints saved with ``save_pretrained``: stand-ins for real
Whisper / Llama weights and a word-level LLM tokenizer (nothing is downloaded)."""

from __future__ import annotations

import torch


def save_tokenizer(path) -> None:
    """A word-level HF tokenizer (a stand-in for a real LLM's) saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "transcribe", "(en):", "(de):", "one", "two",
             "zwei", "drei", "the", "cat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(str(path))


def save_whisper_llama(root, dtype: torch.dtype = torch.float32):
    """Small random Whisper and Llama checkpoints saved with ``save_pretrained`` in ``dtype``
    under ``root/whisper`` and ``root/llama`` (with a tokenizer): stand-ins for real ones."""
    from transformers import LlamaConfig, LlamaForCausalLM, WhisperConfig, WhisperModel

    WhisperModel(WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=1,
                               encoder_attention_heads=2, decoder_attention_heads=2,
                               encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
                               max_source_positions=500, vocab_size=50, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
                 ).to(dtype).save_pretrained(root / "whisper")
    LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, intermediate_size=128,
                                 vocab_size=13)).to(dtype).save_pretrained(root / "llama")
    save_tokenizer(root / "llama")
    return root


def save_voxtral(path, dtype: torch.dtype = torch.float32):
    """A small random Voxtral (audio tower + projector + LM) and tokenizer saved to ``path``."""
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration

    cfg = VoxtralConfig(
        audio_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=256, num_mel_bins=80, max_source_positions=500),
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=13,
                         head_dim=32, max_position_embeddings=512), audio_token_id=12)
    VoxtralForConditionalGeneration(cfg).to(dtype).save_pretrained(path)
    save_tokenizer(path)
    return path


def from_pretrained_model(model_cfg, seed: int = 3):
    """The reference the lean loader is held to: the model as Hugging Face's ``from_pretrained``
    loads it (whole, on the host, in the storage dtype; for Whisper the whole ``WhisperModel``,
    of which the encoder is kept), LoRA applied and the new weights drawn as ``build_model``
    draws them after ``torch.manual_seed(seed)``."""
    from transformers import LlamaForCausalLM, VoxtralForConditionalGeneration, WhisperModel

    from cluster_fl.models import apply_lora, get_arch
    from cluster_fl.models.build import (_shell, _storage_dtype, _tokenizer_for,
                                         init_new_weights)
    from cluster_fl.models.speech_llm import SpeechLLM, StackConnector, VoxtralConnector

    torch.manual_seed(seed)
    new_seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
    spec = get_arch(model_cfg.arch)
    tokenizer = _tokenizer_for(spec, model_cfg)
    dtype = _storage_dtype(model_cfg)
    if spec.family == "voxtral":
        vox = VoxtralForConditionalGeneration.from_pretrained(
            model_cfg.decoder_path, local_files_only=True, dtype=dtype)
        cfg = vox.config
        connector = VoxtralConnector(
            cfg.audio_config.intermediate_size // cfg.audio_config.hidden_size,
            vox.model.multi_modal_projector)
        base = SpeechLLM(spec.name, vox.model.audio_tower, connector, _shell(vox), tokenizer)
    else:
        encoder = WhisperModel.from_pretrained(model_cfg.encoder_path, local_files_only=True,
                                               dtype=dtype).encoder
        decoder = LlamaForCausalLM.from_pretrained(model_cfg.decoder_path,
                                                   local_files_only=True, dtype=dtype)
        connector = StackConnector(spec.stack, encoder.config.d_model,
                                   decoder.config.hidden_size)
        base = SpeechLLM(spec.name, encoder, connector, decoder, tokenizer)
    model = apply_lora(base, model_cfg)
    init_new_weights(model, new_seed)
    return model

"""The speech-LLM module: audio encoder -> connector -> LLM decoder, with its batch interface.

Single-device model code: no distributed logic and no device placement beyond ``.to(device)``.

* The encoder is a Hugging Face Whisper (or Voxtral) encoder whose submodules are run directly
  on variable-length input: the stock ``forward`` insists on 30 s (2 x max_source_positions
  frames) of padding, which would make CPU training ~15x slower on 2 s utterances. Padded frames
  are masked in self-attention and zeroed between the convolutions so a padded batch gives the
  same result as each utterance alone.
* The connector stacks k encoder frames and projects them to the decoder width (Voxtral: its own
  two-layer projector after stacking).
* Audio embeddings precede the text prompt (bos + language token); the loss is cross-entropy on
  the transcript tokens (and eos) only. An optional CTC head on the encoder output is the
  auxiliary loss used in pretraining.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from cluster_fl.models.tokenizer import Tokenizer

IGNORE = -100


@dataclass
class Batch:
    """Padded log-mel features ``(B, n_mels, T)``, their frame counts, transcripts, languages."""

    features: torch.Tensor
    lengths: torch.Tensor
    texts: list[str]
    languages: list[str | None]


def collate(features: Sequence[Any], texts: Sequence[str],
            languages: Sequence[str | None] | None = None) -> Batch:
    """Zero-pad a list of ``(n_mels, T_i)`` arrays/tensors into a :class:`Batch`."""
    mats = [torch.as_tensor(np.asarray(f), dtype=torch.float32) for f in features]
    n_mels = mats[0].shape[0]
    t_max = max(m.shape[1] for m in mats)
    out = torch.zeros(len(mats), n_mels, t_max)
    for i, m in enumerate(mats):
        out[i, :, : m.shape[1]] = m
    lengths = torch.tensor([m.shape[1] for m in mats], dtype=torch.long)
    langs = list(languages) if languages is not None else [None] * len(mats)
    return Batch(out, lengths, list(texts), langs)


def as_batch(batch: Batch | Mapping[str, Any]) -> Batch:
    """Accept a :class:`Batch` or a mapping with features/lengths/texts(/languages) keys."""
    if isinstance(batch, Batch):
        return batch
    get = lambda *keys: next((batch[k] for k in keys if k in batch), None)  # noqa: E731
    feats, lengths = get("features"), get("lengths", "feature_lengths", "n_frames")
    texts, langs = get("texts", "text", "transcripts"), get("languages", "language")
    if isinstance(feats, (list, tuple)):
        return collate(feats, texts, langs)
    feats = torch.as_tensor(feats, dtype=torch.float32)
    if lengths is None:
        lengths = torch.full((feats.shape[0],), feats.shape[-1], dtype=torch.long)
    langs = list(langs) if langs is not None else [None] * feats.shape[0]
    return Batch(feats, torch.as_tensor(lengths, dtype=torch.long), list(texts), langs)


class StackConnector(nn.Module):
    """k-frame stacking then one linear projection to the decoder width (trained fully)."""

    def __init__(self, stack: int, d_in: int, d_out: int):
        super().__init__()
        self.stack = stack
        self.proj = nn.Linear(stack * d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class VoxtralConnector(nn.Module):
    """Voxtral's projector (linear -> act -> linear) after k-frame stacking."""

    def __init__(self, stack: int, projector: nn.Module):
        super().__init__()
        self.stack = stack
        self.projector = projector

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(x)


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's fixed sinusoidal position table."""
    log_inc = np.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-log_inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class SpeechLLM(nn.Module):
    """Encoder -> connector -> decoder; ``loss`` for training, :func:`greedy_decode` to transcribe."""

    def __init__(self, arch: str, encoder: nn.Module, connector: nn.Module, decoder: nn.Module,
                 tokenizer: Tokenizer, ctc_head: nn.Module | None = None):
        super().__init__()
        self.arch = arch
        self.encoder = encoder
        self.connector = connector
        self.decoder = decoder
        self.ctc_head = ctc_head
        self.tokenizer = tokenizer

    def reset_positions(self) -> None:
        """Write sinusoidal encoder positions (random-init tiny models) and keep them frozen."""
        emb = self.encoder.embed_positions
        with torch.no_grad():
            emb.weight.copy_(_sinusoids(*emb.weight.shape))
        emb.weight.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, features: torch.Tensor, lengths: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states ``(B, T', d)`` and valid lengths ``T'_i`` (2x downsampled)."""
        enc = self.encoder
        max_frames = 2 * enc.embed_positions.weight.shape[0]
        if features.shape[-1] > max_frames:  # longer than the encoder's window: truncate
            features, lengths = features[..., :max_frames], lengths.clamp(max=max_frames)
        # Zero the padding before each convolution: a padded utterance then sees the same zeros
        # at its end as it would alone, whatever value the collator padded with.
        keep = (torch.arange(features.shape[-1], device=features.device)[None, :]
                < lengths[:, None]).unsqueeze(1)
        x = nn.functional.gelu(enc.conv1(features * keep))
        x = x * keep
        x = nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)
        out_len = (lengths - 1) // 2 + 1
        x = x + enc.embed_positions.weight[: x.shape[1]].to(x.dtype)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < out_len[:, None]
        mask = torch.zeros(valid.shape, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(~valid, torch.finfo(x.dtype).min)[:, None, None, :]
        x = nn.functional.dropout(x, p=enc.dropout, training=self.training)
        for layer in enc.layers:
            x = layer(x, attention_mask=mask)
        return enc.layer_norm(x), out_len

    def audio_embeddings(self, features: torch.Tensor, lengths: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(audio tokens ``(B, N, D)``, their counts, encoder states, encoder lengths)."""
        states, enc_len = self.encode(features, lengths)
        k = self.connector.stack
        b, t, d = states.shape
        valid = torch.arange(t, device=states.device)[None, :] < enc_len[:, None]
        x = states * valid.unsqueeze(-1)
        pad = (-t) % k
        if pad:
            x = nn.functional.pad(x, (0, 0, 0, pad))
        x = x.reshape(b, (t + pad) // k, k * d)
        return self.connector(x), (enc_len + k - 1) // k, states, enc_len

    # ---- decoder ---------------------------------------------------------------------------
    def _embed(self, ids: list[int]) -> torch.Tensor:
        table = self.decoder.get_input_embeddings()
        return table(torch.tensor(ids, dtype=torch.long, device=self.device))

    def loss(self, batch: Batch | Mapping[str, Any], ctc_weight: float = 0.0
             ) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy over transcript tokens (+ ``ctc_weight`` x CTC) and the token count."""
        batch = as_batch(batch)
        logits, tgt, keep, states, enc_len = self._transcript_logits(batch)
        n_tokens = int(keep.sum())
        loss = nn.functional.cross_entropy(logits.float(), tgt[keep], reduction="mean")
        if ctc_weight > 0.0 and self.ctc_head is not None:
            loss = loss + ctc_weight * self._ctc_loss(states, enc_len, batch.texts)
        return loss, n_tokens

    def row_losses(self, batch: Batch | Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-utterance sums of transcript-token cross-entropy ``(B,)`` and token counts ``(B,)``.

        For batches whose rows belong to different learners (several clients in one step): each
        learner's mean loss is its rows' sum over its rows' count."""
        batch = as_batch(batch)
        logits, tgt, keep, _, _ = self._transcript_logits(batch)
        token = nn.functional.cross_entropy(logits.float(), tgt[keep], reduction="none")
        rows = keep.nonzero()[:, 0]
        b = keep.shape[0]
        sums = torch.zeros(b, dtype=token.dtype, device=token.device).index_add(0, rows, token)
        return sums, keep.sum(dim=1)

    def target_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens each transcript contributes to the loss (its tokens + eos), before any forward."""
        return [len(self.tokenizer.encode(t)) + 1 for t in texts]

    def _transcript_logits(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """LM-head logits on the transcript positions, the targets, their mask, encoder output."""
        dev = self.device
        audio, n_audio, states, enc_len = self.audio_embeddings(
            batch.features.to(dev), batch.lengths.to(dev))
        emb, attn, tgt = self._decoder_inputs(audio, n_audio, batch.texts, batch.languages)
        # no KV cache in training: it costs memory, and a recomputed (checkpointed) layer would
        # append its keys to it twice
        hidden = self.decoder.model(inputs_embeds=emb, attention_mask=attn,
                                    use_cache=False).last_hidden_state
        keep = tgt != IGNORE  # the LM head runs on transcript positions only
        return self.decoder.lm_head(hidden[keep]), tgt, keep, states, enc_len

    def ctc_loss(self, batch: Batch | Mapping[str, Any]) -> torch.Tensor:
        """The auxiliary CTC loss alone: runs only the encoder and the CTC head."""
        if self.ctc_head is None:
            raise ValueError(f"{self.arch} has no CTC head (only random-init tiny models do)")
        batch = as_batch(batch)
        dev = self.device
        states, enc_len = self.encode(batch.features.to(dev), batch.lengths.to(dev))
        return self._ctc_loss(states, enc_len, batch.texts)

    def text_loss(self, texts: Sequence[str], languages: Sequence[str | None]) -> torch.Tensor:
        """The decoder alone as a language model: mean cross-entropy of ``[prompt | text]`` with no
        audio tokens (a text-pretrained LLM's objective; the encoder and connector do not run)."""
        d = self.decoder.get_input_embeddings().weight.shape[1]
        none = torch.zeros(len(texts), 1, d, device=self.device)
        emb, attn, tgt = self._decoder_inputs(none, torch.zeros(len(texts), dtype=torch.long),
                                              texts, languages)
        hidden = self.decoder.model(inputs_embeds=emb, attention_mask=attn,
                                    use_cache=False).last_hidden_state
        keep = tgt != IGNORE
        return nn.functional.cross_entropy(self.decoder.lm_head(hidden[keep]).float(), tgt[keep])

    @torch.no_grad()
    def ctc_transcribe(self, batch: Batch | Mapping[str, Any]) -> list[str]:
        """Greedy CTC transcripts from the encoder and its CTC head (best path: argmax per frame,
        repeats merged, blanks dropped): the encoder's own yardstick, without the decoder."""
        if self.ctc_head is None:
            raise ValueError(f"{self.arch} has no CTC head (only random-init tiny models do)")
        batch = as_batch(batch)
        dev = self.device
        states, enc_len = self.encode(batch.features.to(dev), batch.lengths.to(dev))
        best = self.ctc_head(states).argmax(-1).tolist()
        blank, texts = self.tokenizer.pad_id, []
        for row, n in zip(best, enc_len.tolist()):
            ids = [t for i, t in enumerate(row[:n]) if t != blank and (i == 0 or t != row[i - 1])]
            texts.append(self.tokenizer.decode(ids))
        return texts

    def _decoder_inputs(self, audio: torch.Tensor, n_audio: torch.Tensor, texts: Sequence[str],
                        languages: Sequence[str | None]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded decoder inputs ``[audio_i | prompt_i | text_i]``, mask and targets.

        Built with a few batched gathers rather than per-utterance slices and copies: on CPU the
        per-utterance version spent ~10% of a pretraining step in small copies. Targets are
        IGNORE except on the transcript tokens and eos.
        """
        tok, dev = self.tokenizer, audio.device
        prompts = [tok.prompt_ids(lang) for lang in languages]
        bodies = [tok.encode(text) for text in texts]
        n = n_audio.tolist()
        n_in = [len(p) + len(t) for p, t in zip(prompts, bodies)]  # prompt + text (eos: target)
        b, width = len(bodies), max(n_in)
        length = max(a + m for a, m in zip(n, n_in))
        ids = np.full((b, width), tok.pad_id, dtype=np.int64)
        tgt = np.full((b, length), IGNORE, dtype=np.int64)
        for i, (p, t) in enumerate(zip(prompts, bodies)):
            ids[i, : n_in[i]] = p + t
            start = n[i] + len(p) - 1  # the position that predicts the first transcript token
            tgt[i, start: start + len(t) + 1] = t + [tok.eos_id]
        text = self.decoder.get_input_embeddings()(torch.from_numpy(ids).to(dev))
        pos = torch.arange(length, device=dev)[None, :]
        n_t = n_audio.to(dev)[:, None]
        d = audio.shape[-1]
        from_audio = audio.gather(1, pos.clamp(max=audio.shape[1] - 1).expand(b, -1)
                                  [..., None].expand(-1, -1, d))
        from_text = text.gather(1, (pos - n_t).clamp(0, width - 1)[..., None].expand(-1, -1, d))
        valid = pos < n_t + torch.tensor(n_in, device=dev)[:, None]
        emb = torch.where((pos < n_t)[..., None], from_audio, from_text.to(audio.dtype))
        emb = emb.masked_fill(~valid[..., None], 0.0)
        return emb, valid.long(), torch.from_numpy(tgt).to(dev)

    def _ctc_loss(self, states: torch.Tensor, enc_len: torch.Tensor,
                  texts: Sequence[str]) -> torch.Tensor:
        """CTC on the encoder states; blank is the pad id (never a transcript symbol)."""
        log_probs = self.ctc_head(states).float().log_softmax(-1).transpose(0, 1)
        labels = [self.tokenizer.encode(t) for t in texts]
        flat = torch.tensor([i for lab in labels for i in lab], dtype=torch.long,
                            device=log_probs.device)
        # lengths as plain ints: accepted by the CPU and CUDA kernels alike
        return nn.functional.ctc_loss(log_probs, flat, tuple(enc_len.tolist()),
                                      tuple(len(lab) for lab in labels),
                                      blank=self.tokenizer.pad_id, zero_infinity=True)


@torch.no_grad()
def greedy_decode(model: SpeechLLM, batch: Batch | Mapping[str, Any],
                  max_new_tokens: int = 64) -> list[str]:
    """Batched greedy transcription with a KV cache; prefixes are left-padded."""
    batch = as_batch(batch)
    was_training = model.training
    model.eval()
    dev, tok = model.device, model.tokenizer
    audio, n_audio, _, _ = model.audio_embeddings(batch.features.to(dev), batch.lengths.to(dev))
    prefixes = [torch.cat([audio[i, : int(n_audio[i])], model._embed(tok.prompt_ids(lang))])
                for i, lang in enumerate(batch.languages)]
    b, width = len(prefixes), max(p.shape[0] for p in prefixes)
    emb = torch.zeros(b, width, audio.shape[-1], dtype=audio.dtype, device=dev)
    attn = torch.zeros(b, width, dtype=torch.long, device=dev)
    for i, p in enumerate(prefixes):
        emb[i, width - p.shape[0]:], attn[i, width - p.shape[0]:] = p, 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model.decoder.model(inputs_embeds=emb, attention_mask=attn, position_ids=pos,
                              use_cache=True)
    tokens = torch.zeros(b, 0, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    last_pos = pos[:, -1:]
    for step in range(max_new_tokens):
        nxt = model.decoder.lm_head(out.last_hidden_state[:, -1]).argmax(-1)
        nxt = nxt.masked_fill(done, tok.eos_id)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        done |= nxt == tok.eos_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones(b, 1, dtype=attn.dtype, device=dev)], dim=1)
        last_pos = last_pos + 1
        out = model.decoder.model(inputs_embeds=model.decoder.get_input_embeddings()(nxt[:, None]),
                                  attention_mask=attn, position_ids=last_pos,
                                  cache=out.cache, use_cache=True)
    if was_training:
        model.train()
    texts = []
    for row in tokens.tolist():
        cut = row.index(tok.eos_id) if tok.eos_id in row else len(row)
        texts.append(tok.decode(row[:cut]))
    return texts

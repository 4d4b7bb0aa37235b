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

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from cluster_fl.models.tokenizer import Tokenizer
from cluster_fl.transfer import to_device

IGNORE = -100


@dataclass
class Batch:
    """Padded log-mel features ``(B, n_mels, T)``, their frame counts, transcripts, languages."""

    features: torch.Tensor
    lengths: torch.Tensor
    texts: list[str]
    languages: list[str | None]


@dataclass(frozen=True)
class Buckets:
    """Quanta the step's shapes are rounded up to (1 = exact): mel frames, decoder positions
    (and prompt + text width), transcript targets. Padding to buckets bounds how many distinct
    shapes a run's steps have, so a compiled step is captured a bounded number of times."""

    frames: int = 1
    tokens: int = 1
    targets: int = 1

    @staticmethod
    def round(n: int, quantum: int) -> int:
        return -(-n // quantum) * quantum


def host_list(t: torch.Tensor) -> list:
    """The values of a tensor the host made (a batch's lengths, a step's token counts) as Python
    numbers, read through numpy: nothing waits for a device. A device tensor is read back as
    well, but that is a host synchronisation (tests/gpu/test_sync_free.py counts them)."""
    return t.numpy().tolist() if t.device.type == "cpu" else t.tolist()


def _move(obj: Any, device: torch.device) -> Any:
    """A dataclass of tensors (nested) with every tensor on ``device``: from pinned host memory
    to a GPU, so the copies are asynchronous (the host never waits for the device)."""
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = to_device(v, device)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _move(v, device)
    return dataclasses.replace(obj, **changes)


@dataclass
class EncoderMasks:
    """A padded batch's encoder masks: mel frames kept ``(B, 1, T)``, the additive
    self-attention mask ``(B, 1, 1, T')``, valid encoder frames ``(B, T', 1)``, lengths ``T'``
    and the positions ``0..T'-1`` (an index, so a compiled graph never slices the position table
    by a symbolic size)."""

    frames: torch.Tensor
    attention: torch.Tensor
    valid: torch.Tensor
    out_len: torch.Tensor
    positions: torch.Tensor


@dataclass
class StepInputs:
    """One batch made ready on the host (:meth:`SpeechLLM.prepare`): features, every mask and
    every index of the decoder's input layout and of the transcript targets. Only ``n_tokens``
    stays on the host (the divisor of a mean loss is known before the step)."""

    features: torch.Tensor | None  # (B, n_mels, T) padded log-mels (None: text only)
    encoder: EncoderMasks | None
    ids: torch.Tensor  # (B, W) prompt + text token ids, right-padded
    source: torch.Tensor  # (B, L) index into [audio slots | prompt + text] of each position
    valid: torch.Tensor  # (B, L, 1) 1 on real positions
    attention: torch.Tensor  # (B, 1, L, L) additive causal + padding mask (float32)
    cos: torch.Tensor  # (1, L, head_dim) the decoder's rotary tables
    sin: torch.Tensor
    target_index: torch.Tensor  # (N,) flat position b*L + t of each transcript target (pad: 0)
    target_ids: torch.Tensor  # (N,) the target token (pad: IGNORE)
    target_rows: torch.Tensor  # (N,) the row b of each target (pad: 0)
    n_tokens: torch.Tensor  # (B,) transcript targets per row

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def token_count(self) -> int:
        """Transcript targets in the step (the divisor of its mean loss), from the host."""
        return sum(host_list(self.n_tokens))

    def to(self, device: torch.device) -> "StepInputs":
        """The same inputs on ``device`` (non-blocking copies; pinned host memory makes them
        asynchronous)."""
        return self if self.ids.device == device else _move(self, device)


def _decoder_layout(n_audio: Sequence[int], slots: int, prompts: Sequence[Sequence[int]],
                    bodies: Sequence[Sequence[int]], pad_id: int, eos_id: int,
                    buckets: Buckets) -> dict[str, Any]:
    """Host arithmetic of the decoder's inputs ``[audio_i | prompt_i | text_i]`` (right-padded):
    token ids, each position's source in ``[audio slots | ids]``, masks and the targets (IGNORE
    except on the transcript tokens and eos)."""
    b = len(bodies)
    n_in = [len(p) + len(t) for p, t in zip(prompts, bodies)]  # prompt + text (eos: target only)
    width = Buckets.round(max(n_in), buckets.tokens)
    length = Buckets.round(max(a + m for a, m in zip(n_audio, n_in)), buckets.tokens)
    n_targets = [len(t) + 1 for t in bodies]
    n_slots = Buckets.round(sum(n_targets), buckets.targets)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    source = np.zeros((b, length), dtype=np.int64)
    valid = np.zeros((b, length), dtype=bool)
    index = np.zeros(n_slots, dtype=np.int64)
    tgt_ids = np.full(n_slots, IGNORE, dtype=np.int64)
    rows = np.zeros(n_slots, dtype=np.int64)
    at = 0
    for i, (p, t) in enumerate(zip(prompts, bodies)):
        a, m = n_audio[i], n_in[i]
        ids[i, :m] = list(p) + list(t)
        source[i, :a] = np.arange(a)
        source[i, a:a + m] = slots + np.arange(m)
        valid[i, :a + m] = True
        start = a + len(p) - 1  # the position that predicts the first transcript token
        index[at:at + n_targets[i]] = i * length + start + np.arange(n_targets[i])
        tgt_ids[at:at + n_targets[i]] = list(t) + [eos_id]
        rows[at:at + n_targets[i]] = i
        at += n_targets[i]
    causal = np.tril(np.ones((length, length), dtype=bool))
    allowed = causal[None, :, :] & valid[:, None, :]
    attention = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
    return dict(ids=torch.from_numpy(ids), source=torch.from_numpy(source),
                valid=torch.from_numpy(valid[..., None].astype(np.float32)),
                attention=torch.from_numpy(attention[:, None]),
                target_index=torch.from_numpy(index), target_ids=torch.from_numpy(tgt_ids),
                target_rows=torch.from_numpy(rows),
                n_tokens=torch.tensor(n_targets, dtype=torch.long), length=length)


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
    """Encoder -> connector -> decoder; ``loss`` for training,
    :func:`~cluster_fl.models.decoding.greedy_decode` to transcribe."""

    def __init__(self, arch: str, encoder: nn.Module, connector: nn.Module, decoder: nn.Module,
                 tokenizer: Tokenizer, ctc_head: nn.Module | None = None):
        super().__init__()
        self.arch = arch
        self.encoder = encoder
        self.connector = connector
        self.decoder = decoder
        self.ctc_head = ctc_head
        self.tokenizer = tokenizer
        self.pad_to_window = False  # model.pad_to_window: see encode()

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
    def encoder_masks(self, lengths: torch.Tensor, frames: int) -> EncoderMasks:
        """The masks of a padded batch of ``frames`` mel frames, from its lengths: computed on
        the host by :meth:`prepare` for a training step, on the device when decoding."""
        dev = lengths.device
        keep = (torch.arange(frames, device=dev)[None, :] < lengths[:, None]).unsqueeze(1)
        out_len = (lengths - 1) // 2 + 1
        t_out = (frames - 1) // 2 + 1  # the stride-2 convolution's output length
        valid = torch.arange(t_out, device=dev)[None, :] < out_len[:, None]
        attn = torch.zeros(valid.shape, device=dev).masked_fill(
            ~valid, torch.finfo(torch.float32).min)[:, None, None, :]
        return EncoderMasks(keep.float(), attn, valid.unsqueeze(-1).float(), out_len,
                            torch.arange(t_out, device=dev))

    def encode(self, features: torch.Tensor, lengths: torch.Tensor,
               masks: EncoderMasks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states ``(B, T', d)`` and valid lengths ``T'_i`` (2x downsampled)."""
        enc = self.encoder
        max_frames = 2 * enc.embed_positions.weight.shape[0]
        if features.shape[-1] > max_frames:  # longer than the encoder's window: truncate
            features, lengths = features[..., :max_frames], lengths.clamp(max=max_frames)
            masks = None
        masks = masks or self.encoder_masks(lengths, features.shape[-1])
        if self.pad_to_window:
            return self._encode_window(features, masks, max_frames), masks.out_len
        # Zero the padding before each convolution: a padded utterance then sees the same zeros
        # at its end as it would alone, whatever value the collator padded with.
        x = nn.functional.gelu(enc.conv1(features * masks.frames.to(features.dtype)))
        x = x * masks.frames.to(x.dtype)
        # (B, T', d) in row-major order: the transposed view would reach the layers with strides
        # (T'd, 1, T'), with which a compiled layer's input gradient of a one-row batch is wrong
        # (torch 2.13, inductor on CPU; tests/engine/test_compiled_step.py)
        x = nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1).contiguous()
        x = x + enc.embed_positions.weight.index_select(0, masks.positions).to(x.dtype)
        x = nn.functional.dropout(x, p=enc.dropout, training=self.training)
        mask = masks.attention.to(x.dtype)  # in the activations' dtype: no fp32 (B,H,T,T) sum
        for layer in enc.layers:
            x = layer(x, attention_mask=mask)
        return enc.layer_norm(x), masks.out_len

    def _encode_window(self, features: torch.Tensor, masks: EncoderMasks,
                       max_frames: int) -> torch.Tensor:
        """``model.pad_to_window``: each utterance padded to the encoder's whole window with its
        own silence level (its lowest log-mel value: Whisper's clamp floor, what its extractor's
        zero padding becomes) and encoded over the whole window without a mask -- what Hugging
        Face's ``WhisperEncoder.forward`` computes on 30 s input. Returns the states of the
        batch's own frames ``(B, T', d)``; the valid lengths are the utterances' own."""
        enc = self.encoder
        keep = masks.frames > 0  # (B, 1, T)
        floor = torch.where(keep, features, torch.full_like(features, float("inf"))
                            ).amin(dim=(1, 2), keepdim=True)
        x = torch.where(keep, features, floor)
        x = torch.cat([x, floor.expand(-1, x.shape[1], max_frames - x.shape[-1])], dim=-1)
        x = nn.functional.gelu(enc.conv1(x))
        x = nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1).contiguous()  # as in encode
        x = x + enc.embed_positions.weight.to(x.dtype)
        x = nn.functional.dropout(x, p=enc.dropout, training=self.training)
        for layer in enc.layers:
            x = layer(x, attention_mask=None)
        return enc.layer_norm(x)[:, :masks.attention.shape[-1]]

    def audio_embeddings(self, features: torch.Tensor, lengths: torch.Tensor,
                         masks: EncoderMasks | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(audio tokens ``(B, N, D)``, their counts, encoder states, encoder lengths)."""
        if masks is None and features.shape[-1] <= 2 * self.encoder.embed_positions.weight.shape[0]:
            masks = self.encoder_masks(lengths, features.shape[-1])
        states, enc_len = self.encode(features, lengths, masks)
        k = self.connector.stack
        b, t, d = states.shape
        if masks is not None:
            x = states * masks.valid.to(states.dtype)
        else:
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
        step = self.prepare(batch)
        n_tokens = step.token_count
        loss = self.row_loss_sums(step).sum() / max(n_tokens, 1)
        if ctc_weight > 0.0 and self.ctc_head is not None:
            dev = self.device
            states, enc_len = self.encode(batch.features.to(dev), batch.lengths.to(dev))
            loss = loss + ctc_weight * self._ctc_loss(states, enc_len, batch.texts)
        return loss, n_tokens

    def row_losses(self, batch: Batch | Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-utterance sums of transcript-token cross-entropy ``(B,)`` and token counts ``(B,)``.

        For batches whose rows belong to different learners (several clients in one step): each
        learner's mean loss is its rows' sum over its rows' count."""
        step = self.prepare(as_batch(batch))
        return self.row_loss_sums(step), step.n_tokens

    def target_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens each transcript contributes to the loss (its tokens + eos), before any forward."""
        return [len(self.tokenizer.encode(t)) + 1 for t in texts]

    # ---- the training step's two halves: host preparation, then a device graph -------------
    def audio_token_counts(self, lengths: Sequence[int]) -> list[int]:
        """Audio tokens each utterance of ``lengths`` mel frames becomes (host arithmetic: the
        encoder's window cut, its 2x downsampling, the connector's k-frame stacking)."""
        max_frames = 2 * self.encoder.embed_positions.weight.shape[0]
        k = self.connector.stack
        return [((min(int(n), max_frames) - 1) // 2 + 1 + k - 1) // k for n in lengths]

    def prepare(self, batch: Batch | Mapping[str, Any],
                buckets: Buckets | tuple[int, int, int] | None = None) -> StepInputs:
        """Everything the step needs that depends on sizes, computed on the host before it runs.

        Tokenisation, every length and mask, the decoder's input layout, its rotary tables and
        the transcript targets' positions come from the batch's lengths and texts, so
        :meth:`row_loss_sums` reads nothing back from the device (no ``.item()``, ``.tolist()``
        or boolean indexing) and, with ``buckets``, sees one of a bounded number of shapes (a
        compiled step is reused)."""
        batch = as_batch(batch)
        tok = self.tokenizer
        feats, lengths = batch.features, batch.lengths.to(torch.long)
        max_frames = 2 * self.encoder.embed_positions.weight.shape[0]
        if feats.shape[-1] > max_frames:  # longer than the encoder's window: truncate
            feats, lengths = feats[..., :max_frames], lengths.clamp(max=max_frames)
        buckets = Buckets(*buckets) if isinstance(buckets, tuple) else buckets or Buckets()
        frames = min(buckets.round(feats.shape[-1], buckets.frames), max_frames)
        if frames > feats.shape[-1]:
            feats = nn.functional.pad(feats, (0, frames - feats.shape[-1]))
        k = self.connector.stack
        slots = ((frames - 1) // 2 + 1 + k - 1) // k  # audio tokens of the padded features
        n_audio = self.audio_token_counts(host_list(lengths))
        prompts = [tok.prompt_ids(lang) for lang in batch.languages]
        bodies = [tok.encode(text) for text in batch.texts]
        layout = _decoder_layout(n_audio, slots, prompts, bodies, tok.pad_id, tok.eos_id, buckets)
        cos, sin = self._rotary_table(layout.pop("length"))
        return StepInputs(features=feats, encoder=self.encoder_masks(lengths, frames),
                          cos=cos, sin=sin, **layout)

    def _rotary_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's rotary cos/sin for positions 0..length-1, made on the host (cached)."""
        cache = self.__dict__.setdefault("_rotary_cache", {})
        if length not in cache:
            rotary = self.__dict__.get("_rotary_host")
            if rotary is None:
                src = self.decoder.model.rotary_emb
                if any(b.is_meta for b in src.buffers()):  # a skeleton: rebuilt from the config
                    with torch.device("cpu"):
                        rotary = type(src)(config=self.decoder.model.config)
                else:
                    rotary = copy.deepcopy(src).to("cpu", torch.float32)
                self.__dict__["_rotary_host"] = rotary
            with torch.no_grad():
                cache[length] = rotary(torch.zeros(1), torch.arange(length)[None, :])
        return cache[length]

    def row_loss_sums(self, step: StepInputs) -> torch.Tensor:
        """Per-utterance sums ``(B,)`` of transcript-token cross-entropy: the step's device graph.

        Every shape is fixed by ``step`` and nothing is read back to the host: the graph
        :func:`torch.compile` captures once per bucket."""
        step = step.to(self.device)
        audio, _, _, _ = self.audio_embeddings(step.features, step.encoder.out_len, step.encoder)
        return self._transcript_loss_sums(audio, step)

    def decoder_embeddings(self, audio: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """The decoder's input ``[audio_i | prompt_i | text_i]`` (right-padded, zeros beyond):
        one gather from ``[audio slots | token embeddings]`` at the host-made positions."""
        text = self.decoder.get_input_embeddings()(step.ids)
        d = audio.shape[-1]
        table = torch.cat([audio, text.to(audio.dtype)], dim=1)  # [audio slots | prompt + text]
        return table.gather(1, step.source[..., None].expand(-1, -1, d)) * step.valid.to(audio.dtype)

    def _transcript_loss_sums(self, audio: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """Per-row sums of the transcript tokens' cross-entropy, given the audio tokens."""
        emb = self.decoder_embeddings(audio, step)
        hidden = self._run_decoder(emb, step.attention, (step.cos.to(emb.dtype),
                                                         step.sin.to(emb.dtype)))
        # the LM head runs on the transcript positions only (their flat indices, host-made)
        picked = hidden.reshape(-1, emb.shape[-1]).index_select(0, step.target_index)
        token = nn.functional.cross_entropy(self.decoder.lm_head(picked).float(), step.target_ids,
                                            ignore_index=IGNORE, reduction="none")
        return torch.zeros(step.ids.shape[0], dtype=token.dtype, device=token.device).index_add(
            0, step.target_rows, token)

    def prepare_text(self, texts: Sequence[str], languages: Sequence[str | None]) -> StepInputs:
        """A step of ``[prompt | text]`` sequences without audio (no features, no encoder)."""
        tok = self.tokenizer
        layout = _decoder_layout([0] * len(texts), 0, [tok.prompt_ids(g) for g in languages],
                                 [tok.encode(t) for t in texts], tok.pad_id, tok.eos_id,
                                 Buckets())
        cos, sin = self._rotary_table(layout.pop("length"))
        return StepInputs(features=None, encoder=None, cos=cos, sin=sin, **layout)

    def _run_decoder(self, emb: torch.Tensor, attention: torch.Tensor,
                     rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The LM's layers on ``emb`` with a host-made 4-D additive mask and rotary tables (no KV
        cache in training: it costs memory, and a recomputed layer would append to it twice)."""
        lm = self.decoder.model
        positions = torch.arange(emb.shape[1], device=emb.device)[None, :]
        x = emb
        mask = attention.to(x.dtype)  # in the activations' dtype: no fp32 (B,H,L,L) sum
        for layer in lm.layers[: lm.config.num_hidden_layers]:
            x = layer(x, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                      use_cache=False)
        return lm.norm(x)

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
        host = self.prepare_text(texts, languages)
        step = host.to(self.device)
        table = self.decoder.get_input_embeddings().weight
        none = torch.zeros(len(texts), 0, table.shape[1], dtype=table.dtype, device=self.device)
        return self._transcript_loss_sums(none, step).sum() / max(host.token_count, 1)

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

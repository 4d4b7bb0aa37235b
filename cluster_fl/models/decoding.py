"""Batched greedy transcription: one pass over each utterance's ``[audio | prompt]`` prefix
(left-padded to the batch's widest), then one token a step, with either of two KV caches.

* ``dynamic``: the decoder's own ``forward`` with Hugging Face's growing cache; the cache, the
  mask and the token buffer grow by a column a step (a copy of each), and the host asks the
  device every step whether every row has stopped. The reference.
* ``static``: the cache (:class:`SlotCache`), every step's attention mask, the positions and
  the token buffer are allocated once for ``prefix + max_new_tokens`` slots and indexed by the
  step; the decoder layers run directly (as in the training step), and the host asks whether
  every row has stopped only every :data:`SYNC_EVERY` steps. On a GPU every read is a
  synchronisation that drains the launch queue: a decode of T tokens reads the device
  ceil(T / SYNC_EVERY) + 2 times where the dynamic path reads T + 2 times.

Both give the same tokens and, with eager layers, the same logits bit for bit
(tests/models/test_decoding.py): a step attends over the same keys, in the same shapes, with the
decoder's own masked value (``finfo.min``: exact zeros after the softmax), and a row that has
stopped emits eos, so the steps the static path may run after every row has stopped change no
text. (Compiled layers compile each path's calls separately: the same up to rounding.)
Single-device code, like the model.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cluster_fl.config.schema import DECODE_CACHES
from cluster_fl.models.speech_llm import Batch, SpeechLLM, as_batch, host_list

SYNC_EVERY = 8
"""Static cache: decoded tokens between the host's checks that every row has stopped."""

# Which cache `auto` picks on a CPU: the faster, measured by bench/decode_bench.py (static 1.19x
# the dynamic path's speed with the demo's bf16 compiled layers, 1.24x eager fp32; results/LOG.md)
CPU_AUTO = "static"


def resolve_decode_cache(mode: str, device: torch.device | str) -> str:
    """``static`` or ``dynamic`` for ``mode`` (``eval.decode_cache``) on ``device``: ``auto`` is
    static on a GPU, where each avoided read is an avoided synchronisation, and on a CPU the
    faster of the two as measured (:data:`CPU_AUTO`)."""
    if mode not in DECODE_CACHES:
        raise ValueError(f"decode cache {mode!r}; allowed: {', '.join(DECODE_CACHES)}")
    if mode != "auto":
        return mode
    return "static" if torch.device(device).type == "cuda" else CPU_AUTO


@torch.no_grad()
def greedy_decode(model: SpeechLLM, batch: Batch | Mapping[str, Any],
                  max_new_tokens: int = 64, cache: str = "auto",
                  cut: list[bool] | None = None) -> list[str]:
    """Batched greedy transcription with a KV cache (``cache``: ``auto``, ``static`` or
    ``dynamic``, see the module docstring); prefixes are left-padded. ``cut``, when given, gets
    one flag per row: True when the row reached ``max_new_tokens`` without its end."""
    batch = as_batch(batch)
    mode = resolve_decode_cache(cache, model.device)
    was_training = model.training
    model.eval()
    try:
        emb, attn = _prefix(model, batch)
        run = _decode_static if mode == "static" else _decode_dynamic
        tokens = run(model, emb, attn, max_new_tokens)
    finally:
        if was_training:
            model.train()
    tok, texts = model.tokenizer, []
    for row in tokens.tolist():
        end = row.index(tok.eos_id) if tok.eos_id in row else len(row)
        texts.append(tok.decode(row[:end]))
        if cut is not None:
            cut.append(end == len(row))
    return texts


def _prefix(model: SpeechLLM, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's input ``[audio_i | prompt_i]`` left-padded to ``(B, W, D)`` and its padding
    mask ``(B, W)`` (1 on real positions). Audio token counts are host arithmetic on the batch's
    lengths, so building the prefix reads nothing back from the device."""
    dev, tok = model.device, model.tokenizer
    audio, _, _, _ = model.audio_embeddings(batch.features.to(dev), batch.lengths.to(dev))
    n_audio = model.audio_token_counts(host_list(batch.lengths))
    # every row's prompt embedded at once: one host -> device copy of the ids, not one per row
    prompts = [tok.prompt_ids(lang) for lang in batch.languages]
    embedded = model._embed([i for ids in prompts for i in ids]).split([len(p) for p in prompts])
    prefixes = [torch.cat([audio[i, :n], e]) for i, (n, e) in enumerate(zip(n_audio, embedded))]
    b, width = len(prefixes), max(p.shape[0] for p in prefixes)
    emb = torch.zeros(b, width, audio.shape[-1], dtype=audio.dtype, device=dev)
    attn = torch.zeros(b, width, dtype=torch.long, device=dev)
    for i, p in enumerate(prefixes):
        emb[i, width - p.shape[0]:], attn[i, width - p.shape[0]:] = p, 1
    return emb, attn


def _decode_dynamic(model: SpeechLLM, emb: torch.Tensor, attn: torch.Tensor,
                    max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens ``(B, <= max_new_tokens)`` through the decoder's ``forward`` and its growing
    cache (eos after a row's stop); reads ``done`` back every step."""
    decoder: Any = model.decoder  # a LlamaForCausalLM (or Voxtral's LM in its shape)
    dev, eos = emb.device, model.tokenizer.eos_id
    b = emb.shape[0]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = decoder.model(inputs_embeds=emb, attention_mask=attn, position_ids=pos, use_cache=True)
    tokens = torch.zeros(b, 0, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    last_pos = pos[:, -1:]
    for step in range(max_new_tokens):
        nxt = decoder.lm_head(out.last_hidden_state[:, -1]).argmax(-1)
        nxt = nxt.masked_fill(done, eos)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        done |= nxt == eos
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones(b, 1, dtype=attn.dtype, device=dev)], dim=1)
        last_pos = last_pos + 1
        out = decoder.model(inputs_embeds=decoder.get_input_embeddings()(nxt[:, None]),
                            attention_mask=attn, position_ids=last_pos, cache=out.cache,
                            use_cache=True)
    return tokens


def _decode_static(model: SpeechLLM, emb: torch.Tensor, attn: torch.Tensor,
                   max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens ``(B, max_new_tokens)`` (eos after a row's stop) with everything allocated
    before the first step: the cache's ``W + max_new_tokens - 1`` slots (the last token is never
    fed back), the additive mask of every query slot, the positions and the token buffer. Reads
    ``done`` back every :data:`SYNC_EVERY` steps."""
    decoder: Any = model.decoder
    lm, head, embed = decoder.model, decoder.lm_head, decoder.get_input_embeddings()
    dev, eos = emb.device, model.tokenizer.eos_id
    b, width, _ = emb.shape
    slots = width + max_new_tokens - 1
    cache = SlotCache(slots)
    # a key is visible if it is a real prefix position or a generated token, and not in the future
    real = torch.cat([attn.bool(), torch.ones(b, slots - width, dtype=torch.bool, device=dev)], 1)
    slot = torch.arange(slots, device=dev)
    visible = real[:, None, :] & (slot[None, None, :] <= slot[None, :, None])  # (B, query, key)
    # additive, in the activations' dtype with its minimum: the decoder's own eager mask (exact
    # zeros after the softmax; a fully masked padding row stays finite)
    masks = torch.zeros(visible.shape, dtype=emb.dtype, device=dev).masked_fill_(
        ~visible, torch.finfo(emb.dtype).min)[:, None]  # (B, 1, slots, slots)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    steps = pos[:, -1:] + torch.arange(1, max_new_tokens, device=dev)[None, :]  # (B, T - 1)
    tokens = torch.full((b, max_new_tokens), eos, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)

    cache.advance(width)
    hidden = _layers(lm, emb, masks[:, :, :width, :width], pos, cache)
    for t in range(max_new_tokens):
        nxt = head(hidden[:, -1]).argmax(-1).masked_fill_(done, eos)
        tokens[:, t] = nxt
        done |= nxt == eos
        if t == max_new_tokens - 1 or ((t + 1) % SYNC_EVERY == 0 and bool(done.all())):
            break
        at = cache.advance(1)  # the slot this step's token is written to
        hidden = _layers(lm, embed(nxt[:, None]), masks[:, :, at:at + 1, :at + 1],
                         steps[:, t:t + 1], cache)
    return tokens


class SlotCache:
    """Every decoder layer's keys and values in a buffer allocated once (at the first write, with
    the keys' shape and dtype) and written at host-known slots. A layer's attention gets a view
    of the slots filled so far: the keys, shapes and reduction lengths of Hugging Face's growing
    cache -- so the same logits, bitwise -- without its copy of the whole cache every token.
    (HF's ``StaticCache`` hands every layer all ``max_cache_len`` slots, fixed shapes for CUDA
    graphs, and so sums the softmax over masked slots too: logits ~1e-6 off the dynamic path's.)

    Duck-typed to what a decoder layer's attention calls, ``update(keys, values, layer_idx)``."""

    def __init__(self, slots: int):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slots, self.start, self.end = slots, 0, 0

    def advance(self, n: int) -> int:
        """Start the next forward: it writes ``n`` slots; returns the first."""
        self.start, self.end = self.end, self.end + n
        return self.start

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.keys:
            b, h, _, d = key.shape
            self.keys[layer_idx] = key.new_empty(b, h, self.slots, d)
            self.values[layer_idx] = value.new_empty(b, h, self.slots, value.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:, :, self.start:self.end] = key
        values[:, :, self.start:self.end] = value
        return keys[:, :, :self.end], values[:, :, :self.end]


def _layers(lm: Any, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
            cache: SlotCache) -> torch.Tensor:
    """The LM's layers on ``x`` at ``positions`` with a 4-D additive ``mask`` over the filled
    slots, writing each layer's keys and values to ``cache``; the last hidden states."""
    rotary = lm.rotary_emb(x, positions)
    for layer in lm.layers[: lm.config.num_hidden_layers]:
        x = layer(x, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                  cache=cache, use_cache=True)
    return lm.norm(x)

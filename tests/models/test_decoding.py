"""Greedy decoding with the static cache gives the dynamic path's tokens -- and its logits, bit
for bit -- on every tiny preset, and reads the device back every SYNC_EVERY tokens instead of
every token.

The batch mixes prefixes of different widths (left padding), the lengths run below and above
the natural stop, and rows are made to stop at chosen steps (a large eos bias on the LM head's
output for that row from that step on), before and after a host check and all of them before
the limit, so the static path runs steps past the dynamic path's last.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from host_syncs import HostReads

from cluster_fl.config import load_config
from cluster_fl.models import build_model, collate, get_trainable, greedy_decode, set_trainable
from cluster_fl.models.decoding import (SYNC_EVERY, _decode_dynamic, _decode_static, _prefix,
                                        resolve_decode_cache)

PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs" / "arch").glob("*-tiny.yaml"))
ROWS = 6


class _LMHead(torch.nn.Module):
    """The decoder's LM head, recording its logits; ``stops`` row -> step: from that call on the
    row's eos logit is raised by 1e4 (it stops there); ``no_eos``: eos is never chosen."""

    def __init__(self, head: torch.nn.Module, eos: int, stops: dict[int, int] | None = None,
                 no_eos: bool = False):
        super().__init__()
        self.head, self.eos, self.stops, self.no_eos = head, eos, stops or {}, no_eos
        self.logits: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.head(hidden).clone()
        step = len(self.logits)
        for row, at in self.stops.items():
            if step >= at:
                out[row, self.eos] += 1e4
        if self.no_eos:
            out[:, self.eos] = -1e4
        self.logits.append(out)
        return out


@pytest.fixture(scope="module", params=[p.stem for p in PRESETS])
def tiny(request, make_examples):
    """(model, batch) for a preset: LoRA moved off its zero init, so tokens vary and some rows
    stop on their own; transcripts of different lengths give prefixes of different widths."""
    torch.set_num_threads(1)
    cfg = load_config(PRESETS[[p.stem for p in PRESETS].index(request.param)])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    g = torch.Generator().manual_seed(1)
    set_trainable(model, {k: v + 0.2 * torch.randn(v.shape, generator=g)
                          for k, v in get_trainable(model).items()})
    ex = make_examples(ROWS, 1)
    batch = collate([e.features for e in ex], [e.transcript for e in ex],
                    [e.language for e in ex])
    return model, batch


def _both(model, batch, max_new_tokens: int, **head_kw):
    """(tokens, logits) of the dynamic path, then of the static path, with a recording head."""
    real, out = model.decoder.lm_head, []
    try:
        for run in (_decode_dynamic, _decode_static):
            model.decoder.lm_head = head = _LMHead(real, model.tokenizer.eos_id, **head_kw)
            with torch.no_grad():
                emb, attn = _prefix(model, batch)
                out.append((run(model, emb, attn, max_new_tokens), head.logits))
    finally:
        model.decoder.lm_head = real
    return out


def _assert_same(dynamic, static, eos: int, max_new_tokens: int) -> None:
    (tok_d, logits_d), (tok_s, logits_s) = dynamic, static
    n = tok_d.shape[1]
    assert tok_s.shape == (ROWS, max_new_tokens)
    assert torch.equal(tok_s[:, :n], tok_d)
    assert (tok_s[:, n:] == eos).all()  # steps after every row stopped: eos, cut from the text
    assert len(logits_s) >= len(logits_d)
    for a, b in zip(logits_d, logits_s):
        assert torch.equal(a, b)


def test_the_batch_has_prefixes_of_different_widths(tiny):
    model, batch = tiny
    with torch.no_grad():
        _, attn = _prefix(model, batch)
    widths = attn.sum(1).tolist()
    assert len(set(widths)) > 2 and (attn[:, -1] == 1).all()  # left-padded


@pytest.mark.parametrize("max_new_tokens", [1, 5, SYNC_EVERY, 61])
def test_static_equals_dynamic_token_for_token(tiny, max_new_tokens):
    model, batch = tiny
    eos = model.tokenizer.eos_id
    dynamic, static = _both(model, batch, max_new_tokens)
    _assert_same(dynamic, static, eos, max_new_tokens)
    assert greedy_decode(model, batch, max_new_tokens, cache="static") == \
        greedy_decode(model, batch, max_new_tokens, cache="dynamic")


def test_rows_that_stop_early_stay_stopped(tiny):
    model, batch = tiny
    eos = model.tokenizer.eos_id
    stops = {0: 0, 2: 3, 3: SYNC_EVERY + 1}  # at the first step, before and after a host check
    dynamic, static = _both(model, batch, 40, stops=stops)
    _assert_same(dynamic, static, eos, 40)
    tokens = static[0]
    for row, at in stops.items():
        assert tokens[row, at] == eos and (tokens[row, at:] == eos).all()


def test_every_row_stopping_before_the_limit_ends_both_paths(tiny):
    model, batch = tiny
    eos = model.tokenizer.eos_id
    stops = {row: 2 + 2 * row for row in range(ROWS)}  # the last row stops at step 12 (or before)
    dynamic, static = _both(model, batch, 60, stops=stops)
    _assert_same(dynamic, static, eos, 60)
    last = max(row.index(eos) for row in dynamic[0].tolist())
    assert last <= 12
    assert dynamic[0].shape[1] == last + 1  # the dynamic path ends at the step every row has
    # the static path at the next host check
    assert len(static[1]) == math.ceil((last + 1) / SYNC_EVERY) * SYNC_EVERY < 60


def test_static_decode_reads_the_device_every_sync_every_tokens(tiny):
    # a decode of T tokens that no row ends early: the static path reads back at most
    # ceil(T / SYNC_EVERY) times plus 2 (the batch's lengths for the prefix, the tokens at the
    # end); the dynamic path at least once a token
    model, batch = tiny
    real, t, counts, sites = model.decoder.lm_head, 40, {}, {}
    model.decoder.lm_head = _LMHead(real, model.tokenizer.eos_id, no_eos=True)
    try:
        for mode in ("static", "dynamic"):
            with pytest.MonkeyPatch.context() as mp:
                reads = HostReads(mp)
                greedy_decode(model, batch, t, cache=mode)
                counts[mode] = reads.n
                sites[mode] = reads.report()
    finally:
        model.decoder.lm_head = real
    assert SYNC_EVERY >= 8  # the point of the static path: at least 8x fewer reads
    assert counts["static"] <= math.ceil(t / SYNC_EVERY) + 2, (counts, sites["static"])
    assert counts["dynamic"] >= t, counts


def test_auto_is_static_on_a_gpu_and_a_bad_mode_is_refused():
    assert resolve_decode_cache("auto", "cuda") == "static"
    assert resolve_decode_cache("auto", "cpu") in ("static", "dynamic")
    assert resolve_decode_cache("dynamic", "cuda") == "dynamic"
    with pytest.raises(ValueError, match="auto, static, dynamic"):
        resolve_decode_cache("paged", "cpu")

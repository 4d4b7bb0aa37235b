"""Peak memory per rank of a client lane, G = 2 (FSDP2 over gloo) vs G = 1, on CPU.

    python bench/lane_memory.py [--layers 12 --hidden 1024 --steps 2 --dtype float32]

A ~210M-parameter random Llama decoder (hidden 1024, 12 layers, ffn 4096, vocab 8192, tied)
behind the tiny Whisper encoder, LoRA on q/k/v, built the way the engine builds it
(``build_model``-style assembly, then :func:`cluster_fl.dist.parallelize.parallelize`). Each
configuration runs in fresh processes, side by side in one run:

* ``G=1``: one process, unsharded;
* ``G=2``: two gloo ranks forming one lane, frozen base sharded with FSDP2.

Each rank samples its resident set (psutil, every 2 ms) and reports two peaks over its baseline
(the RSS after ``import torch, transformers``): **training** -- from the moment the model is
placed (built and sharded) to the end of ``--steps`` client steps (forward + backward of a batch
of 8 utterances + AdamW), the figure that corresponds to GPU memory on a cluster, where the
unsharded copy never reaches the GPU; and **process** -- the whole life including the build,
where on CPU every rank first builds the whole model (from_pretrained does the same). The goal
(issue 12) is training peak G=2 / G=1 <= 0.6.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Sampler:
    """Peak RSS of this process from a background thread."""

    def __init__(self, every_s: float = 0.002):
        import psutil

        self.proc, self.every_s = psutil.Process(), every_s
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.every_s)

    def reset(self) -> int:
        rss = self.proc.memory_info().rss
        self.peak = rss
        return rss

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.proc.memory_info().rss)


def build(args):
    """The ~200M speech-LLM with LoRA (random init)."""
    import torch

    from cluster_fl.config import ModelConfig
    from cluster_fl.models.build import _assemble, _configs
    from cluster_fl.models.lora import apply_lora
    from cluster_fl.models.registry import get_arch
    from cluster_fl.models.tokenizer import CharTokenizer

    spec = get_arch("whisper-tinyllama-tiny")
    tok = CharTokenizer()
    cfg = ModelConfig(arch=spec.name, dtype=args.dtype,
                      activation_checkpointing=args.checkpointing)
    enc_cfg, dec_cfg = _configs(spec, len(tok), cfg)
    dec_cfg.hidden_size, dec_cfg.num_hidden_layers = args.hidden, args.layers
    dec_cfg.intermediate_size, dec_cfg.num_attention_heads = 4 * args.hidden, args.hidden // 64
    dec_cfg.num_key_value_heads, dec_cfg.head_dim = args.hidden // 64, 64
    dec_cfg.vocab_size = 8192
    torch.manual_seed(0)
    model = _assemble(spec, enc_cfg, dec_cfg, tok, with_ctc=False)
    return apply_lora(model, cfg), cfg


def batch(n: int = 8):
    import torch

    g = torch.Generator().manual_seed(1)
    texts = ["the cat sat on the mat " * 2] * n
    return {"features": torch.randn(n, 80, 300, generator=g), "lengths": torch.full((n,), 300),
            "texts": texts, "languages": ["en"] * n}


def rank_main(comm, args) -> dict:
    import torch
    import transformers  # noqa: F401 -- part of the baseline

    from cluster_fl.dist.parallelize import LaneLayout, parallelize
    from cluster_fl.engine.client import release_memory
    from cluster_fl.models.lora import trainable_parameters

    torch.set_num_threads(1)
    sampler = Sampler()
    base = sampler.reset()
    model, cfg = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    g = comm.world_size
    if g > 1:
        from dataclasses import replace

        cfg = replace(cfg, shard="fsdp2", shard_group_size=g)
    placement = parallelize(model, cfg, torch.device("cpu"), LaneLayout(g, g, comm.rank))
    release_memory()  # hand the unsharded copy's pages back before the training window
    process_peak_build = sampler.peak
    sampler.reset()
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    data = batch()
    t = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        placement.backward(model, data, params)
        opt.step()
    step_s = (time.perf_counter() - t) / args.steps
    train_peak = sampler.stop()
    return {"params": n_params, "train_mib": (train_peak - base) / 2**20,
            "process_mib": (max(process_peak_build, train_peak) - base) / 2**20,
            "step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing of every layer")
    args = parser.parse_args()
    from cluster_fl.dist import spawn

    one = spawn(rank_main, 1, args, use_fake=True, timeout_s=900)[0]
    two = spawn(rank_main, 2, args, timeout_s=900)
    worst = max(two, key=lambda r: r["train_mib"])
    print(f"model: {one['params'] / 1e6:.0f}M parameters, base {args.dtype}, checkpointing "
          f"{'on' if args.checkpointing else 'off'}, "
          f"{args.steps} client steps of 8 utterances, 1 thread per rank")
    print(f"{'':>6} {'train peak MiB':>15} {'process peak MiB':>17} {'s/step':>8}")
    print(f"{'G=1':>6} {one['train_mib']:15.0f} {one['process_mib']:17.0f} {one['step_s']:8.2f}")
    for r, res in enumerate(two):
        print(f"{'G=2 r' + str(r):>6} {res['train_mib']:15.0f} {res['process_mib']:17.0f} "
              f"{res['step_s']:8.2f}")
    print(f"ratio training peak per rank G=2/G=1: {worst['train_mib'] / one['train_mib']:.2f} "
          f"(goal <= 0.6); process peak: {max(r['process_mib'] for r in two) / one['process_mib']:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

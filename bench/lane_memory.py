"""Peak host memory per rank of a client lane, G = 2 (FSDP2 over gloo) vs G = 1, on CPU.

    python bench/lane_memory.py [--layers 12 --hidden 1024 --steps 2 --dtype float32]

A ~210M-parameter Llama decoder (hidden 1024, 12 layers, ffn 4096, vocab 8192, tied) behind the
tiny Whisper encoder, LoRA on q/k/v, saved once as local checkpoints (``save_pretrained``:
safetensors, random weights) under ``--work`` and loaded the way the engine loads a real
architecture (``whisper-tinyllama`` with ``model.encoder_path`` / ``decoder_path``):

* ``G=1``: one process, ``from_pretrained`` of the whole base, unsharded;
* ``G=2``: two gloo ranks forming one lane: the base built on the meta device, FSDP2 shards
  allocated and only their rows read from the checkpoint.

Each configuration runs in fresh processes, side by side in one run. Each rank samples its
resident set (psutil, every 2 ms) and reports three peaks over its baseline (the RSS after
``import torch, transformers``):

* **load** -- build, load and place the model, then read each of the rank's weights once (what
  a copy to a GPU does: ``from_pretrained`` maps the safetensors file and its pages become
  resident only when read). The host memory a rank needs before it trains: on a GPU cluster the
  whole of it, since training then lives on the device. The scale checks' figure (goal G=2 / G=1 <=
  0.6);
* **train** -- from the moment the model is placed to the end of ``--steps`` client steps
  (forward + backward of a batch of 8 utterances + AdamW): on CPU the host memory of training;
* **process** -- the whole life, the larger of the two.

glibc's mmap and trim thresholds are pinned (``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``
= 128 KiB) so freed large buffers leave the resident set instead of staying in the heap.
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


def save_checkpoints(args) -> Path:
    """The ~200M stand-in saved once under ``--work`` (encoder, decoder, word-level tokenizer)."""
    import json

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                              WhisperConfig, WhisperModel)

    root = Path(args.work).expanduser() / f"lane-{args.layers}x{args.hidden}"
    if (root / "done.json").is_file():
        return root
    torch.manual_seed(0)
    WhisperModel(WhisperConfig(d_model=128, encoder_layers=3, encoder_attention_heads=4,
                               encoder_ffn_dim=512, decoder_layers=1, decoder_attention_heads=4,
                               decoder_ffn_dim=512, num_mel_bins=80, max_source_positions=1500,
                               vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               decoder_start_token_id=1)).save_pretrained(root / "whisper")
    LlamaForCausalLM(LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                 intermediate_size=4 * args.hidden,
                                 num_attention_heads=args.hidden // 64,
                                 num_key_value_heads=args.hidden // 64, head_dim=64,
                                 vocab_size=8192, tie_word_embeddings=True)
                     ).save_pretrained(root / "llama")
    words = ["<pad>", "<s>", "</s>", "<unk>", "transcribe", "(en):", "the", "cat", "sat", "on",
             "mat"] + [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(str(root / "llama"))
    (root / "done.json").write_text(json.dumps({"layers": args.layers, "hidden": args.hidden}))
    return root


def model_config(args, root: Path, group_size: int):
    from cluster_fl.config import ModelConfig

    return ModelConfig(arch="whisper-tinyllama", encoder_path=str(root / "whisper"),
                       decoder_path=str(root / "llama"), lora_rank=4, lora_alpha=8.0,
                       dtype=args.dtype, activation_checkpointing=args.checkpointing,
                       shard="fsdp2" if group_size > 1 else "none",
                       shard_group_size=group_size)


def batch(n: int = 8):
    import torch

    g = torch.Generator().manual_seed(1)
    texts = ["the cat sat on the mat " * 2] * n
    return {"features": torch.randn(n, 80, 300, generator=g), "lengths": torch.full((n,), 300),
            "texts": texts, "languages": ["en"] * n}


def rank_main(comm, args, root) -> dict:
    import torch
    import transformers  # noqa: F401 -- part of the baseline

    from cluster_fl.distributed.parallelize import LaneLayout, parallelize
    from cluster_fl.engine.client import release_memory
    from cluster_fl.models import build_model
    from cluster_fl.models.lora import trainable_parameters

    torch.set_num_threads(1)
    sampler = Sampler()
    base = sampler.reset()
    g = comm.world_size
    cfg = model_config(args, root, g)
    torch.manual_seed(0)
    model = build_model(cfg, meta=g > 1)  # the engine's rule (setup.sharded_from_meta)
    n_params = sum(p.numel() for p in model.parameters())
    placement = parallelize(model, cfg, torch.device("cpu"), LaneLayout(g, g, comm.rank))
    release_memory()
    with torch.no_grad():  # every weight this rank holds, read once (as a copy to a GPU would)
        for p in model.parameters():
            float((p.to_local() if hasattr(p, "to_local") else p).float().sum())
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
            "load_mib": (process_peak_build - base) / 2**20,
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
    parser.add_argument("--work", default="~/.cache/cluster_fl/bench",
                        help="where the stand-in checkpoints are saved (once)")
    args = parser.parse_args()
    from cluster_fl.distributed import spawn

    root = save_checkpoints(args)
    one = spawn(rank_main, 1, args, root, use_fake=True, timeout_s=900)[0]
    two = spawn(rank_main, 2, args, root, timeout_s=900)
    worst = {key: max(r[key] for r in two) for key in ("load_mib", "train_mib", "process_mib")}
    print(f"model: {one['params'] / 1e6:.0f}M parameters from local safetensors, base "
          f"{args.dtype}, checkpointing {'on' if args.checkpointing else 'off'}, "
          f"{args.steps} client steps of 8 utterances, 1 thread per rank, load {os.getloadavg()[0]:.1f}")
    print(f"{'':>6} {'load peak MiB':>14} {'train peak MiB':>15} {'process peak MiB':>17} "
          f"{'s/step':>8}")
    for name, res in [("G=1", one)] + [(f"G=2 r{r}", res) for r, res in enumerate(two)]:
        print(f"{name:>6} {res['load_mib']:14.0f} {res['train_mib']:15.0f} "
              f"{res['process_mib']:17.0f} {res['step_s']:8.2f}")
    ratio = {key: worst[key] / one[key] for key in worst}
    print(f"ratio per rank G=2/G=1 (worst rank): load {ratio['load_mib']:.2f} (goal <= 0.6), "
          f"train {ratio['train_mib']:.2f}, process {ratio['process_mib']:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # read by the spawned ranks' glibc
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
    main()

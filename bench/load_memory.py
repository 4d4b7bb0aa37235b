"""Peak host memory of loading real checkpoints at real widths, per rank.

    python bench/load_memory.py --work /tmp/cfl-load [--decoder-layers 1] [--cases all]

Writes two Hugging Face folders with ``save_pretrained`` in bf16 (once, kept under ``--work``):

* ``whisper``: whisper-large-v3's widths (d_model 1280, 32 encoder layers, 128 mel bins, 1500
  positions) as a whole ``WhisperModel``; its decoder is cut to 2 layers -- it is in the file
  only to show that the loader never reads it;
* ``eurollm``: EuroLLM-9B's widths (hidden 4096, ffn 12288, 32/8 heads, vocabulary 128000,
  untied head) with the depth cut to ``--decoder-layers`` to fit a 24 GiB machine shared with
  others; a word-level tokenizer.

Then, each case in fresh processes, loads them the way a run does (``build_model(meta=True)`` +
``distributed.parallelize``: every tensor allocated once on the device in the run's dtype and
read into it from ``safe_open(...).get_slice``, 64 MiB of file at a time): bf16 files as bf16 and
as fp32, G = 1 (one process) and G = 2 (an FSDP2 lane of two gloo ranks, each reading its rows).

Per rank it reports the bytes it holds (parameters -- its shards at G = 2 -- and buffers) and its
peak resident set over the whole process (``getrusage``: imports, build, load), and checks the
issue's bound: peak <= 1.2 x held + 2 GiB. Weights are random; memory depends on shapes only.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "models"))

GIB = 1024 ** 3


def write_checkpoints(work: Path, decoder_layers: int) -> None:
    """The two folders, in bf16, unless already there."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, WhisperConfig, WhisperModel

    from hf_checkpoints import save_tokenizer

    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 2B parameters
    if not (work / "whisper" / "config.json").is_file():
        WhisperModel(WhisperConfig(
            d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
            decoder_layers=2, decoder_attention_heads=20, decoder_ffn_dim=5120,
            num_mel_bins=128, max_source_positions=1500, vocab_size=51866,
            pad_token_id=50256, bos_token_id=50257, eos_token_id=50257,
            decoder_start_token_id=50258)).save_pretrained(work / "whisper")
    if not (work / "eurollm" / "config.json").is_file():
        LlamaForCausalLM(LlamaConfig(
            hidden_size=4096, num_hidden_layers=decoder_layers, num_attention_heads=32,
            num_key_value_heads=8, intermediate_size=12288, vocab_size=128000,
            max_position_embeddings=4096, tie_word_embeddings=False)
        ).save_pretrained(work / "eurollm")
        save_tokenizer(work / "eurollm")
    torch.set_default_dtype(torch.float32)


def _cfg(work: Path, dtype: str, g: int):
    from cluster_fl.config import ModelConfig

    return ModelConfig(arch="whisper-eurollm-9b", encoder_path=str(work / "whisper"),
                       decoder_path=str(work / "eurollm"), dtype=dtype, lora_rank=16,
                       compile=False, shard="fsdp2" if g > 1 else "none", shard_group_size=g)


def _held_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


def load_worker(comm, work: str, dtype: str, g: int) -> dict:
    """One rank: build on meta, place, load; its held bytes and peak RSS."""
    import torch

    from cluster_fl.distributed.parallelize import LaneLayout, parallelize
    from cluster_fl.models import build_model

    torch.manual_seed(0)
    cfg = _cfg(Path(work), dtype, g)
    t0 = time.perf_counter()
    model = build_model(cfg, meta=True)
    parallelize(model, cfg, torch.device("cpu"), LaneLayout(g, g, comm.rank))
    seconds = time.perf_counter() - t0
    held = _held_bytes(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rank": comm.rank, "held_bytes": held, "peak_rss_bytes": peak,
            "bound_bytes": int(1.2 * held + 2 * GIB), "load_s": round(seconds, 1),
            "dtypes": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the checkpoints")
    parser.add_argument("--decoder-layers", type=int, default=1)
    parser.add_argument("--cases", default="all",
                        help="comma-separated dtype:G, e.g. bfloat16:1,float32:2 (default all)")
    args = parser.parse_args()
    from cluster_fl.distributed import spawn

    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_checkpoints(args.work, args.decoder_layers)
    print(f"checkpoints under {args.work} ({time.perf_counter() - t0:.0f} s)", flush=True)
    cases = ([("bfloat16", 1), ("float32", 1), ("bfloat16", 2), ("float32", 2)]
             if args.cases == "all" else
             [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")])
    rows, ok = [], True
    for dtype, g in cases:
        for r in spawn(load_worker, g, str(args.work), dtype, g, timeout_s=1800,
                       use_fake=g == 1, threads=1):
            within = r["peak_rss_bytes"] <= r["bound_bytes"]
            ok &= within
            rows.append({"files": "bfloat16", "dtype": dtype, "G": g, **r, "within": within})
            print(f"bf16 files as {dtype:8s} G={g} rank {r['rank']}: holds "
                  f"{r['held_bytes'] / GIB:5.2f} GiB, peak RSS {r['peak_rss_bytes'] / GIB:5.2f} "
                  f"GiB, bound {r['bound_bytes'] / GIB:5.2f} GiB -> "
                  f"{'within' if within else 'OVER'} (load {r['load_s']} s, base "
                  f"{','.join(r['dtypes'])})", flush=True)
    print(json.dumps(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

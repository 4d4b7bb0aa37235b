"""GPU figures for issue 12 (run by ``bench/gpu_check.sh`` on a machine with one CUDA GPU).

    python bench/gpu_step.py big   [--arch whisper-eurollm-9b --batch 4 --seconds 15]
    python bench/gpu_step.py speed [--clients 64 --rounds 2 --ks 1,16,64]

``big``: the architecture's skeleton is built on the meta device at real dimensions (random
init: no weights are read), cast to the dtype policy on meta (frozen base bf16, LoRA +
connector fp32), materialised on the GPU and initialised there, then one client step (forward +
backward of a batch + AdamW) runs with activation checkpointing. Prints the peak GPU memory
(``torch.cuda.max_memory_allocated``) and the step time, as JSON on the last line.

``speed``: client updates per second of the tiny model on the GPU (bf16 base) for each K clients
per batched step (one pass per step), with peak memory, through the round
engine, on the synthetic corpus rendered into ``--work``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def big(args: argparse.Namespace) -> dict:
    import torch

    from cluster_fl.config import ModelConfig
    from cluster_fl.dist.parallelize import apply_dtype, parallelize
    from cluster_fl.models.build import build_skeleton
    from cluster_fl.models.lora import apply_lora, trainable_parameters
    from cluster_fl.models.tokenizer import CharTokenizer

    cfg = ModelConfig(arch=args.arch, dtype="bfloat16", activation_checkpointing=True,
                      lora_rank=args.lora_rank)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    model = apply_lora(build_skeleton(cfg), cfg)  # meta device: shapes only
    apply_dtype(model, torch.bfloat16)  # on meta: the fp32 copy never exists
    model.to_empty(device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.tokenizer = CharTokenizer()  # any tokenizer: ids stay inside the vocabulary
    n_params = sum(p.numel() for p in model.parameters())
    placement = parallelize(model, cfg, dev)
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    frames = int(args.seconds * 100)  # 10 ms hop
    mels = model.encoder.conv1.in_channels
    g = torch.Generator().manual_seed(0)
    batch = {"features": torch.randn(args.batch, mels, frames, generator=g),
             "lengths": torch.full((args.batch,), frames),
             "texts": ["the quick brown fox jumps over the lazy dog " * 4] * args.batch,
             "languages": ["en"] * args.batch}
    if cuda:
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        placement.backward(model, batch, params)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"arch": args.arch, "parameters": n_params, "batch": args.batch,
            "seconds": args.seconds, "step_s": min(times),
            **({"weights_gib": weights / 2**30,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                "gpu": torch.cuda.get_device_name(0)} if cuda else {"device": "cpu"})}


def speed(args: argparse.Namespace) -> dict:
    """Client updates/s for each K in ``--ks`` (batched clients per step, one pass per step)."""
    from cluster_fl.config import load_config
    from cluster_fl.data import make_corpus
    from cluster_fl.dist import LocalComm
    from cluster_fl.engine import setup

    work = Path(args.work)
    corpus = work / "corpus"
    if not corpus.exists():
        make_corpus(corpus, languages=["en", "de"], seed=0, public_speakers=2,
                    private_speakers=(args.clients + 1) // 2, test_speakers=1,
                    public_utterances=4, private_utterances=(16, 16), test_utterances=4,
                    progress=False)
    out = {"clients_per_round": args.clients, "rounds": args.rounds, "dtype": args.dtype}
    for k in [int(x) for x in args.ks.split(",")]:
        cfg = load_config(ROOT / "cluster_fl" / "assets" / "demo.yaml", [
            f"data.corpus={corpus}", "data.languages=[en,de]", f"run.out={work / 'runs'}",
            f"fl.clients_per_round={args.clients}", "fl.sampling=fixed", "fl.max_local_steps=4",
            "fl.batch_size=4", "run.device=cuda", f"model.dtype={args.dtype}",
            f"fl.clients_per_step={k}", f"fl.rows_per_pass={args.rows_per_pass}"])
        world = setup.build_world(cfg, LocalComm(), lambda m: None)
        state = world.initial_state
        world.engine.run_round(1, state)  # warm-up (CUDA context, kernels, feature cache)
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for r in range(2, 2 + args.rounds):
            state = world.engine.run_round(r, state).state
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        out[f"K={k}"] = {"client_updates_per_s": args.clients * args.rounds / elapsed,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
        print(json.dumps({f"K={k}": out[f"K={k}"]}), flush=True)
        del world
    base = out["K=1"]["client_updates_per_s"] if "K=1" in out else None
    if base:
        out["ratios_vs_K1"] = {key: v["client_updates_per_s"] / base
                               for key, v in out.items() if key.startswith("K=")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("big")
    b.add_argument("--arch", default="whisper-eurollm-9b")
    b.add_argument("--batch", type=int, default=4)
    b.add_argument("--seconds", type=float, default=15.0)
    b.add_argument("--lora-rank", type=int, default=16)
    b.add_argument("--steps", type=int, default=2)
    b.add_argument("--device", default="cuda", help="cuda:0 for the figures; cpu to smoke-test")
    s = sub.add_parser("speed")
    s.add_argument("--clients", type=int, default=64)
    s.add_argument("--ks", default="1,16,64", help="clients per batched step to compare")
    s.add_argument("--rows-per-pass", type=int, default=0)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--work", default="/tmp/cluster_fl_gpu")
    args = parser.parse_args()
    out = big(args) if args.what == "big" else speed(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

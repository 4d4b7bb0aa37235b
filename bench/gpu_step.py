"""GPU figures of the cluster path (run by ``bench/gpu_check.sh`` on a machine with one CUDA GPU).

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


H200_BF16_DENSE = 989e12  # FLOP/s, NVIDIA's dense bf16 figure (MFU's denominator)


def _batch(model, n: int, seconds: float) -> dict:
    import torch

    frames = int(seconds * 100)  # 10 ms hop
    mels = model.encoder.conv1.in_channels
    g = torch.Generator().manual_seed(0)
    return {"features": torch.randn(n, mels, frames, generator=g),
            "lengths": torch.full((n,), frames),
            "texts": ["the quick brown fox jumps over the lazy dog " * 4] * n,
            "languages": ["en"] * n}


def step_flops(cfg, n: int, seconds: float, checkpointing: bool) -> int:
    """FLOPs of one client step (forward + backward) counted from the shapes alone on the meta
    device (``torch.utils.flop_counter``: matmuls, convolutions, attention). Without
    checkpointing: the model's work; with it: the hardware's (the recomputed forwards too)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from cluster_fl.distributed.parallelize import apply_activation_checkpointing, apply_dtype
    from cluster_fl.models.build import build_skeleton
    from cluster_fl.models.lora import apply_lora
    from cluster_fl.models.tokenizer import CharTokenizer

    model = apply_lora(build_skeleton(cfg), cfg)
    apply_dtype(model, torch.float32)  # FLOPs do not depend on the dtype; meta has no autocast
    model.tokenizer = CharTokenizer()
    if checkpointing:
        apply_activation_checkpointing(model)
    model.train()
    with FlopCounterMode(display=False) as counter:
        step = model.prepare(_batch(model, n, seconds)).to(torch.device("meta"))
        loss = model.row_loss_sums(step).sum()
        loss.backward()
    return counter.get_total_flops()


def big(args: argparse.Namespace) -> dict:
    """One client step of a real-size architecture (random init, bf16 base, LoRA) per batch size
    in ``--batches``, with and without activation checkpointing: step time, peak memory, and
    MFU = model FLOPs / step time / the H200's dense bf16 peak."""
    import torch

    from cluster_fl.config import ModelConfig
    from cluster_fl.distributed.parallelize import apply_dtype, parallelize
    from cluster_fl.models.build import build_skeleton
    from cluster_fl.models.lora import apply_lora, trainable_parameters
    from cluster_fl.models.tokenizer import CharTokenizer

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    out = {"arch": args.arch, "seconds": args.seconds, "lora_rank": args.lora_rank, "steps": {}}
    for ckpt in [c == "on" for c in args.checkpointing.split(",")]:
        cfg = ModelConfig(arch=args.arch, dtype="bfloat16", activation_checkpointing=ckpt,
                          lora_rank=args.lora_rank, compile=args.compile)
        model = apply_lora(build_skeleton(cfg), cfg)  # meta device: shapes only
        apply_dtype(model, torch.bfloat16)  # on meta: the fp32 copy never exists
        model.to_empty(device=dev)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        model.tokenizer = CharTokenizer()  # any tokenizer: ids stay inside the vocabulary
        out["parameters"] = sum(p.numel() for p in model.parameters())
        placement = parallelize(model, cfg, dev)
        params = trainable_parameters(model)
        opt = torch.optim.AdamW(params.values(), lr=1e-4)
        for n in [int(b) for b in args.batches.split(",")]:
            key = f"batch={n} checkpointing={'on' if ckpt else 'off'}"
            batch = _batch(model, n, args.seconds)
            try:
                if cuda:
                    torch.cuda.synchronize()
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
            except torch.OutOfMemoryError:
                out["steps"][key] = "out of memory"
                print(json.dumps({key: "out of memory"}), flush=True)
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            if cuda:  # host synchronisations of one more step (sizes are prepared on the host)
                import warnings

                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        opt.zero_grad(set_to_none=True)
                        placement.backward(model, batch, params)
                        opt.step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = sum("synchroniz" in str(w.message) for w in caught)
            model_flops = step_flops(cfg, n, args.seconds, checkpointing=False)
            hw_flops = step_flops(cfg, n, args.seconds, checkpointing=ckpt)
            step_s = min(times[1:] or times)
            row = {"step_s": step_s, "model_tflop": model_flops / 1e12,
                   "hardware_tflop": hw_flops / 1e12,
                   "mfu": model_flops / step_s / H200_BF16_DENSE,
                   "hfu": hw_flops / step_s / H200_BF16_DENSE}
            if cuda:
                row.update(syncs_per_step=syncs, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                           reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
            out["steps"][key] = row
            print(json.dumps({key: row}), flush=True)
        del model, opt, params, placement
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def speed(args: argparse.Namespace) -> dict:
    """Client updates/s of the study's client workload (tiny model, batch 8, 4 local steps) for
    each variant in ``--variants`` (``K[c]``: K clients per batched step, ``c`` = compiled; one
    pass per step), with peak memory and the host synchronisations of one timed round.
    ``--study``: at the pre-registered study's heavy-regime client settings (encoder LR x 0.1,
    per-layer flat DP at sigma 0.1, C = 1, exact diagnostics), with the GPU-busy share of one
    round (kernel time / wall, torch.profiler) and, given ``--estimate-updates``, the hours that
    many client updates take at the measured rate (one run at a time)."""
    import warnings

    import torch

    from cluster_fl.config import load_config
    from cluster_fl.data import make_corpus
    from cluster_fl.models.registry import resolve_shapes  # a benchmark is a run's entrance
    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine import setup

    work = Path(args.work)
    corpus = work / f"corpus-{args.clients}"
    if not corpus.exists():
        make_corpus(corpus, languages=["en", "de"], seed=0, public_speakers=2,
                    private_speakers=(args.clients + 1) // 2, test_speakers=1,
                    public_utterances=4, private_utterances=(16, 16), test_utterances=4,
                    progress=False)
    cuda = args.device == "cuda"
    out = {"clients_per_round": args.clients, "rounds": args.rounds, "dtype": args.dtype}
    for variant in args.variants.split(","):
        k, compiled = int(variant.rstrip("c")), variant.endswith("c")
        cfg = resolve_shapes(load_config(ROOT / "cluster_fl" / "assets" / "demo.yaml", [
            f"data.corpus={corpus}", "data.languages=[en,de]", f"run.out={work / 'runs'}",
            f"fl.clients_per_round={args.clients}", "fl.sampling=fixed", "fl.max_local_steps=4",
            "fl.batch_size=8", f"run.device={args.device}", f"model.dtype={args.dtype}",
            f"model.compile={str(compiled).lower()}", f"fl.clients_per_step={k}",
            "fl.rows_per_pass=0", "model.checkpoint=null", "model.connector_init=checkpoint",
            *(STUDY_HEAVY if args.study else [])]))
        world = setup.build_world(cfg, LocalComm(), lambda m: None)
        state = world.initial_state
        t = time.perf_counter()
        state = world.engine.run_round(1, state).state  # warm-up: compile, kernels, caches
        first = time.perf_counter() - t
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for r in range(2, 2 + args.rounds):
            state = world.engine.run_round(r, state).state
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        row = {"client_updates_per_s": args.clients * args.rounds / elapsed,
               "first_round_s": first}
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    world.engine.run_round(2 + args.rounds, state)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            steps = args.clients * 4 / k  # batched steps in the round
            row.update(syncs_per_round=syncs, syncs_per_step=syncs / steps)
            row["gpu_busy_share"] = gpu_busy_share(world, 3 + args.rounds, state)
        if args.estimate_updates:
            row["estimate_hours"] = args.estimate_updates / row["client_updates_per_s"] / 3600
        out[variant] = row
        print(json.dumps({variant: row}), flush=True)
        del world
    return out


# the pre-registered study's heavy-regime client settings (configs/grids/repro-heavy.yaml)
STUDY_HEAVY = ["model.freeze_encoder=false", "client.lr_encoder_mult=0.1",
               "privacy.mechanism=gaussian", "privacy.clipping=flat", "privacy.clip_norm=1.0",
               "privacy.noise_multiplier=0.1", "privacy.grouping=layer",
               "privacy.diagnostics=exact"]


def gpu_busy_share(world, round_: int, state) -> float:
    """Kernel time on the GPU / wall time of one round (torch.profiler's CUDA activity)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        world.engine.run_round(round_, state)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return busy_us / 1e6 / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("big")
    b.add_argument("--arch", default="whisper-eurollm-9b")
    b.add_argument("--batches", default="4")
    b.add_argument("--checkpointing", default="on", help="on, off or on,off")
    b.add_argument("--compile", action="store_true")
    b.add_argument("--seconds", type=float, default=15.0)
    b.add_argument("--lora-rank", type=int, default=16)
    b.add_argument("--steps", type=int, default=2)
    b.add_argument("--device", default="cuda", help="cuda:0 for the figures; cpu to smoke-test")
    s = sub.add_parser("speed")
    s.add_argument("--clients", type=int, default=64)
    s.add_argument("--variants", default="1,1c,64c",
                   help="K clients per batched step, with a trailing c for the compiled step")
    s.add_argument("--device", default="cuda")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--dtype", default="auto")
    s.add_argument("--work", default="/tmp/cluster_fl_gpu")
    s.add_argument("--study", action="store_true",
                   help="the study's heavy-regime client settings, and the GPU-busy share")
    s.add_argument("--estimate-updates", type=int, default=0,
                   help="client updates to estimate the wall time of at the measured rate")
    args = parser.parse_args()
    out = big(args) if args.what == "big" else speed(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Benchmark: greedy decoding with the static cache against the dynamic one, side by side.

Decides what ``eval.decode_cache: auto`` means on a CPU (``CPU_AUTO`` in
``cluster_fl/models/decoding.py``). A random-init model of the demo's config (its architecture,
and its dtype and compile policy as ``parallelize`` applies them on this machine, unless
overridden) transcribes synthetic utterances in the evaluation's batches, both caches in one
process with interleaved repetitions (the order alternates), so a machine's load falls on both
alike. Each decode is checked to give the same hypotheses. Prints each repetition, the medians
and the ratio dynamic / static (above 1: static is faster).

    python bench/decode_bench.py --reps 5 --utterances 64 --max-new-tokens 96
    python bench/decode_bench.py model.compile=false model.dtype=float32   # eager fp32
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def synthetic_utterances(n: int, n_mels: int, seed: int) -> list[dict]:
    """``n`` utterances of random log-mel features, 1.5 to 4.5 s (the demo's sentences), with
    short transcripts (decoding runs to ``max_new_tokens`` or eos whatever they say)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    langs = ("en", "de", "fr", "pl")
    return [{"features": torch.tensor(rng.standard_normal((n_mels, int(rng.integers(150, 450)))),
                                      dtype=torch.float32),
             "transcript": "a b", "language": langs[i % len(langs)]} for i in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "cluster_fl" / "assets" / "demo.yaml"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--utterances", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    import torch

    from cluster_fl.config import load_config
    from cluster_fl.models.registry import resolve_shapes  # a benchmark is a run's entrance
    from cluster_fl.distributed.parallelize import parallelize
    from cluster_fl.eval import transcribe
    from cluster_fl.models import build_model

    torch.set_num_threads(args.threads)
    cfg = resolve_shapes(load_config(args.config, args.overrides))
    torch.manual_seed(args.seed)
    model = build_model(cfg.model).eval()
    placement = parallelize(model, cfg.model, torch.device("cpu"))
    utts = synthetic_utterances(args.utterances, model.encoder.conv1.in_channels, args.seed)
    print(f"{cfg.model.arch} random init, base {str(placement.dtype).removeprefix('torch.')}, "
          f"{'compiled' if placement.compiled_layers else 'eager'} layers, {args.threads} "
          f"thread(s); {len(utts)} utterances in batches of {cfg.eval.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}")

    def run(mode: str) -> tuple[float, list[str]]:
        start = time.perf_counter()
        with placement.compute():
            hyps = transcribe(model, utts, cfg.eval.batch_size, args.max_new_tokens,
                              decode_cache=mode)
        return time.perf_counter() - start, hyps

    modes = ("static", "dynamic")
    for mode in modes:  # warm-up: first calls, compiled layers' graphs
        print(f"warm-up {mode}: {run(mode)[0]:.2f} s", flush=True)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.reps):
        reference = None
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            seconds, hyps = run(mode)
            assert reference is None or hyps == reference, "the caches' hypotheses differ"
            reference = hyps
            times[mode].append(seconds)
        print(f"rep {rep}: static {times['static'][-1]:.2f} s, dynamic "
              f"{times['dynamic'][-1]:.2f} s", flush=True)
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"median: static {med['static']:.2f} s, dynamic {med['dynamic']:.2f} s; "
          f"dynamic / static = {med['dynamic'] / med['static']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Round-engine benchmarks, each measured side by side in one run on this machine.

    python bench/engine_bench.py overhead   # DP round (alpha-split + secure sum + noise) / FedAvg
    python bench/engine_bench.py ranks      # throughput 2 ranks / 1 rank (gloo, same cohort)
    python bench/engine_bench.py memory     # peak RSS of a round at 100 vs 10 clients per round
                                            # (and 100 clients with 16 per batched step)
    python bench/engine_bench.py trim       # round time: heap trimmed after every client vs
                                            # only past the RSS bound (HeapTrimmer)
    python bench/engine_bench.py all

A small synthetic corpus is rendered once into ``--work`` (default /tmp/cluster_fl_bench). The
tiny model starts from random init: speed and memory do not depend on the weights. Goals (issue
4): overhead <= 1.02, 2-rank speed-up >= 1.85, RSS ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def corpus(work: Path, speakers: int) -> Path:
    from cluster_fl.data import make_corpus

    out = work / f"corpus-{speakers}"
    make_corpus(out, languages=["en", "de"], seed=0, public_speakers=2, private_speakers=speakers,
                test_speakers=1, public_utterances=4, private_utterances=(16, 16),
                test_utterances=4, progress=False)
    return out


def config(corpus_dir: Path, work: Path, **over):
    from cluster_fl.config import load_config, override
    from cluster_fl.models.registry import resolve_shapes  # a benchmark is a run's entrance

    cfg = resolve_shapes(load_config(ROOT / "cluster_fl" / "assets" / "demo.yaml"))
    base = {"data.corpus": str(corpus_dir), "data.languages": ["en", "de"],
            "fl.max_local_steps": 2, "fl.batch_size": 8, "fl.sampling": "fixed",
            "run.out": str(work / "runs"), "run.threads": 1, "eval.max_utterances": 4,
            "eval.bootstrap": 10}
    base.update(over)
    return override(cfg, base)


def time_round(cfg, rounds: int = 1) -> float:
    """Median wall time of ``rounds`` rounds of a freshly built world (1 process)."""
    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine import setup

    comm = LocalComm()
    setup.set_threads(cfg, comm)
    world = setup.build_world(cfg, comm, lambda m: None)
    state, times = world.initial_state, []
    for r in range(1, rounds + 1):
        t = time.perf_counter()
        state = world.engine.run_round(r, state).state
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def overhead(work: Path, reps: int) -> dict:
    c = corpus(work, 8)
    dp = config(c, work, **{"fl.clients_per_round": 8, "privacy.clipping": "alpha-split"})
    plain = config(c, work, **{"fl.clients_per_round": 8, "privacy.mechanism": "none",
                               "aggregation.secure_sum": False})
    time_round(plain, 1)  # warm the feature cache and the allocator
    a, b = [], []
    for _ in range(reps):  # interleaved, so machine noise hits both alike
        a.append(time_round(dp, 2))
        b.append(time_round(plain, 2))
    ratio = statistics.median(a) / statistics.median(b)
    return {"dp_round_s": statistics.median(a), "fedavg_round_s": statistics.median(b),
            "overhead_ratio": ratio, "reps": reps, "clients_per_round": 8}


def _rank_worker(comm, cfg_dict: dict, rounds: int) -> float:
    from cluster_fl.config import build_config
    from cluster_fl.engine import setup

    cfg = build_config(cfg_dict)
    world = setup.build_world(cfg, comm, lambda m: None)
    state = world.initial_state
    comm.barrier()
    t = time.perf_counter()
    for r in range(1, rounds + 1):
        state = world.engine.run_round(r, state).state
    comm.barrier()
    return time.perf_counter() - t


def ranks(work: Path, rounds: int) -> dict:
    from cluster_fl.config import to_dict
    from cluster_fl.distributed import spawn

    c = corpus(work, 8)
    cfg = to_dict(config(c, work, **{"fl.clients_per_round": 8}))
    one = max(spawn(_rank_worker, 1, cfg, rounds, use_fake=True, timeout_s=1800, threads=1))
    two = max(spawn(_rank_worker, 2, cfg, rounds, timeout_s=1800, threads=1))
    return {"one_rank_s": one, "two_ranks_s": two, "speedup": one / two, "rounds": rounds,
            "threads_per_rank": 1}


def memory(work: Path) -> dict:
    from cluster_fl.data import FeatureStore, load_utterances

    c = corpus(work, 50)  # rendered and featurised here, so both measured runs only read caches
    FeatureStore(c, progress=False).examples(load_utterances(c, splits=["private", "test"]))
    out = {}
    for n, k in ((10, 1), (100, 1), (100, 16)):
        code = (f"import sys, resource; sys.path.insert(0, {str(ROOT / 'bench')!r});"
                "import engine_bench as b; from pathlib import Path;"
                f"w=Path({str(work)!r}); c=b.corpus(w, 50);"
                f"cfg=b.config(c, w, **{{'fl.clients_per_round': {n}, 'fl.max_local_steps': 1,"
                f"'fl.clients_per_step': {k}}});"
                "b.time_round(cfg, 1);"
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        out[f"peak_rss_mb_{n}" + (f"_k{k}" if k > 1 else "")] = \
            int(res.stdout.strip().splitlines()[-1]) / 1024
    out["rss_ratio_100_vs_10"] = out["peak_rss_mb_100"] / out["peak_rss_mb_10"]
    out["rss_ratio_k16_vs_k1"] = out["peak_rss_mb_100_k16"] / out["peak_rss_mb_100"]
    return out


def trim(work: Path, reps: int) -> dict:
    """Round time with the heap trimmed after every client vs only past the RSS bound."""
    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine import setup
    from cluster_fl.engine.client import HeapTrimmer

    c = corpus(work, 24)
    cfg = config(c, work, **{"fl.clients_per_round": 24, "fl.sampling": "fixed",
                             "fl.batch_size": 4, "fl.max_local_steps": 4})
    setup.set_threads(cfg, LocalComm())
    world = setup.build_world(cfg, LocalComm(), lambda m: None)
    state = world.initial_state
    world.engine.run_round(1, state)
    every, bounded = HeapTrimmer(fraction=0.0, min_bytes=-1), HeapTrimmer()
    times: dict[str, list[float]] = {"every_client": [], "past_bound": []}
    for rep in range(reps):  # interleaved; every round a new number (secure masks are per round)
        for i, (name, trimmer) in enumerate((("every_client", every), ("past_bound", bounded))):
            world.engine.trimmer = trimmer
            t = time.perf_counter()
            world.engine.run_round(2 + 2 * rep + i, state)
            times[name].append(time.perf_counter() - t)
    a, b = statistics.median(times["every_client"]), statistics.median(times["past_bound"])
    return {"round_s_trim_every_client": a, "round_s_trim_past_bound": b,
            "speedup": a / b, "trims_past_bound": bounded.trims,
            "clients_past_bound": 24 * reps, "reps": reps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["overhead", "ranks", "memory", "trim", "all"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/cluster_fl_bench"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    todo = ["overhead", "ranks", "memory", "trim"] if args.what == "all" else [args.what]
    for what in todo:
        t = time.perf_counter()
        res = {"overhead": lambda: overhead(args.work, args.reps),
               "ranks": lambda: ranks(args.work, args.rounds),
               "memory": lambda: memory(args.work),
               "trim": lambda: trim(args.work, args.reps)}[what]()
        res["bench_wall_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps({what: res}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

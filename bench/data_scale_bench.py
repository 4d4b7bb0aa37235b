"""Host memory and start-up of a round, on a corpus and on one with 10x the speakers.

    python bench/data_scale_bench.py [--speakers 60] [--utterances 20] [--factor 10]

Writes two OpenSLR-layout corpora (FLAC, the writer of ``tests/mls_layouts.py``) into ``--work``:
``--speakers`` training speakers and ``--factor`` times as many, every speaker with the same
``--utterances`` utterances (so every client is the same size), the same test speaker in both.
Each store is filled with ``cluster-fl features`` (timed, not compared), then one round of
``cluster-fl train`` runs in its own process on each: the same cohort size of clients of the same
size, fixed sampling, the tiny model on the CPU. Reported per corpus: peak RSS of the training
process (``wait4``'s ``ru_maxrss``), start-up (process start to the run's first log line, i.e.
config, clients from the store's indexes and model built) and the whole run. Goals: RSS ratio
<= 1.1, start-up ratio <= 1.5 (the large corpus over the small).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def write_corpus(out: Path, speakers: int, utterances: int) -> Path:
    from mls_layouts import write_openslr

    if (out / "mls_german" / "test" / "transcripts.txt").exists():
        return out
    train = {f"{1000 + s}": utterances for s in range(speakers)}
    return write_openslr(out, "german", {"train": train, "test": {"9999": 8}})


def config(corpus: Path, work: Path, name: str, cohort: int) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(json.dumps({
        "model": {"arch": "whisper-tinyllama-tiny"},
        "data": {"corpus": str(corpus), "languages": ["de"], "client_split": "train",
                 "eval_split": "test"},
        "fl": {"rounds": 1, "sampling": "fixed", "clients_per_round": cohort,
               "max_local_steps": 2, "batch_size": 4},
        "eval": {"max_utterances": 4, "bootstrap": 10},
        "run": {"out": str(work / "runs"), "experiment": name, "threads": 1,
                "device": "cpu"}}))
    return path


def timed(cmd: list[str], first_line: str | None = None) -> dict:
    """Run ``cmd``; its peak RSS (MiB), seconds to the first stderr line containing
    ``first_line``, and seconds in all."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    startup = None
    tail = []
    for line in proc.stderr:
        tail = (tail + [line])[-20:]
        if startup is None and first_line and first_line in line:
            startup = time.monotonic() - start
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        sys.exit(f"{' '.join(cmd)} failed:\n{''.join(tail)}")
    return {"rss_mib": usage.ru_maxrss / 1024, "startup_s": startup,
            "total_s": time.monotonic() - start}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--speakers", type=int, default=60)
    ap.add_argument("--utterances", type=int, default=20)
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--cohort", type=int, default=8)
    ap.add_argument("--work", default="/tmp/cluster_fl_data_scale")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "cluster_fl"]
    results = {}
    for name, speakers in (("small", args.speakers), ("large", args.speakers * args.factor)):
        corpus = write_corpus(work / f"corpus-{speakers}", speakers, args.utterances)
        cfg = config(corpus, work, f"{name}-{speakers}", args.cohort)
        features = timed(cli + ["features", str(cfg)])
        run = timed(cli + ["train", str(cfg), f"run.run_id=r{time.time_ns()}"],
                    first_line=" clients, q=")
        results[name] = {"speakers": speakers, "features_s": round(features["total_s"], 1),
                         "rss_mib": round(run["rss_mib"], 1),
                         "startup_s": round(run["startup_s"], 2),
                         "round_total_s": round(run["total_s"], 2)}
        print(name, results[name], flush=True)
    small, large = results["small"], results["large"]
    summary = {"cpu": cpu_name(), "utterances_per_speaker": args.utterances,
               "cohort": args.cohort, **results,
               "rss_ratio": round(large["rss_mib"] / small["rss_mib"], 3),
               "startup_ratio": round(large["startup_s"] / small["startup_s"], 3)}
    print(json.dumps(summary, indent=2))
    ok = summary["rss_ratio"] <= 1.1 and summary["startup_ratio"] <= 1.5
    print("goals (RSS <= 1.1, start-up <= 1.5):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()

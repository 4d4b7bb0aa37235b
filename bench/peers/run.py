"""Peer benchmark driver: client updates/s of cluster_fl, pfl-research and Flower on
the same work, measured side by side in one run.

    python -m bench.peers.run                                  # everything, at the benchmark's sizes
    python -m bench.peers.run --frameworks cluster_fl --ks 1 --ranks 1 --rounds 2 --reps 1
    python -m bench.peers.run --device cuda --ks 1,24 --ranks 1   # on one GPU

Every cell (framework x privacy x processes [x K]) runs in a fresh process; repetitions are
interleaved (each repetition runs every cell once, in a rotated order) and the table reports
the median rate. A cell that fails (a peer that cannot start, K > 1 before the batched path
exists) is reported as failed with its reason; the others still run. The table is followed by
one JSON line (``{"peers_bench": ...}``) with every repetition's numbers.

Rate = client updates counted by the harness in the timed rounds / wall time of those rounds;
one untimed warm-up round first; setup (imports, model, Ray, process groups) excluded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.peers` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.common import PRIVACY, ROOT, Work, prepare  # noqa: E402

FRAMEWORKS = ("cluster_fl", "pfl", "flower")


@dataclass(frozen=True)
class Cell:
    framework: str
    privacy: str
    procs: int
    k: int | None = None          # cluster_fl's fl.clients_per_step
    precision: str | None = None  # a peer's forward: fp32 or bf16 (autocast); None: the Work's

    @property
    def label(self) -> str:
        k = f" K={self.k}" if self.k is not None else ""
        prec = f" {self.precision}" if self.precision else ""
        return f"{self.framework} {self.privacy} {self.procs}p{k}{prec}"

    def work(self, work: Work) -> Work:
        """The Work this cell runs: the peers' precision set to the cell's."""
        return replace(work, peer_precision=self.precision) if self.precision else work

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def run_cell(cell: Cell, work: Work) -> dict:
    """Run one cell in this process (the driver calls this through ``--cell``)."""
    if cell.framework == "cluster_fl":
        from bench.peers import cluster_fl_harness as h

        res = h.run_cell(work, cell.privacy, cell.procs, cell.k or 1)
    elif cell.framework == "pfl":
        from bench.peers import pfl_harness as h

        res = h.run_cell(work, cell.privacy, cell.procs)
    elif cell.framework == "flower":
        from bench.peers import flower_harness as h

        res = h.run_cell(work, cell.privacy, cell.procs)
    else:
        raise ValueError(f"unknown framework {cell.framework!r}")
    from cluster_fl.malloc import active_malloc

    return {**res.to_dict(), "malloc": active_malloc()}  # the allocator this process ran on


def cell_env(cell: Cell, peers_malloc: bool = False) -> dict[str, str]:
    """A cell's environment: cluster_fl's cells get the allocator its CLI preloads
    (cluster_fl/malloc.py: jemalloc or tcmalloc when installed); the peers run on the system's,
    as their users would run them, unless ``peers_malloc`` gives them the same."""
    from cluster_fl.malloc import preload_malloc

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if cell.framework == "cluster_fl" or peers_malloc:
        preload_malloc(env)
    return env


def run_cell_process(cell: Cell, work: Work, timeout_s: float, peers_malloc: bool = False
                     ) -> dict:
    """Run one cell in a fresh Python process; failures come back as ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "bench.peers.run", "--cell", cell.to_json(),
           "--work-json", cell.work(work).to_json()]
    env = cell_env(cell, peers_malloc)
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                           env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"error": (lines[-1] if lines else f"exit {p.returncode}")[:300],
                "stderr_tail": p.stderr[-3000:]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t
    return out


def peer_precisions(choice: str, device: str) -> list[str]:
    """The peers' forward precisions to measure. ``best``: on a CPU both fp32 and bf16 autocast
    (which is faster depends on the core: cluster_fl's own eager step was slower in bf16 on the
    Intel AMX core, pfl-research's loop 1.28x faster in bf16 on an AMD core with AVX-512-BF16,
    results/LOG.md, 2026-12-04 and 2026-12-06; the faster cell is the peer's figure), on a GPU bf16
    autocast (what their users write there); ``auto``: bf16 on a GPU, fp32 on a CPU; ``fp32`` /
    ``bf16``: that one."""
    if choice == "best":
        return ["fp32", "bf16"] if device == "cpu" else ["bf16"]
    if choice == "auto":
        return ["fp32"] if device == "cpu" else ["bf16"]
    return [choice]


def cells_for(args: argparse.Namespace) -> list[Cell]:
    cells = []
    precisions = peer_precisions(args.peer_precision, args.device)
    for privacy in args.privacy:
        for fw in args.frameworks:
            for procs in args.ranks:
                if fw == "cluster_fl":
                    ks = args.ks if procs == 1 else [k for k in args.multi_ks]
                    cells += [Cell(fw, privacy, procs, k) for k in ks]
                else:
                    cells += [Cell(fw, privacy, procs, precision=p) for p in precisions]
    return cells


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("torch", "numpy", "pfl", "flwr", "ray"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["cluster_fl_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["cluster_fl_commit"] = None
    return out


def summarise(cells: list[Cell], runs: dict[Cell, list[dict]]) -> list[dict]:
    rows = []
    for c in cells:
        ok = [r for r in runs[c] if "error" not in r]
        rates = [r["rate"] for r in ok if math.isfinite(r["rate"])]
        row = {**c.__dict__, "rates": rates, "median_rate": statistics.median(rates) if rates
               else None, "updates": [r["updates"] for r in ok],
               "round_s": statistics.median([s for r in ok for s in r["round_s"]]) if ok
               else None, "errors": [r["error"] for r in runs[c] if "error" in r],
               "worker_processes": sorted({r["extra"].get("worker_processes") for r in ok}
                                          - {None}),
               "malloc": sorted({r.get("malloc", "system") for r in ok})}
        rows.append(row)
    return rows


def table(rows: list[dict], work: Work, reps: int) -> str:
    where = "1 torch thread per process" if work.device == "cpu" else f"on {work.device}"
    head = (f"client updates/s, median of {reps} interleaved rep(s); {work.clients} clients/round, "
            f"{work.local_steps} AdamW steps x {work.batch_size} utterances, {work.rounds} timed "
            f"round(s) after 1 warm-up, {where}")
    lines = [head, "", f"{'framework':<11} {'privacy':<7} {'procs':>5} {'K':>3} {'peer':>5} "
             f"{'updates/s':>10} {'min-max':>15} {'s/round':>8} {'updates':>8}  malloc",
             "-" * 96]
    for r in rows:
        k = "-" if r["k"] is None else str(r["k"])
        prec = r.get("precision") or "-"
        cell = f"{r['framework']:<11} {r['privacy']:<7} {r['procs']:>5} {k:>3} {prec:>5}"
        if r["median_rate"] is None:
            lines.append(f"{cell} {'FAILED':>10}  {r['errors'][0] if r['errors'] else ''}")
            continue
        spread = f"{min(r['rates']):.2f}-{max(r['rates']):.2f}"
        lines.append(f"{cell} {r['median_rate']:>10.2f} {spread:>15} {r['round_s']:>8.2f} "
                     f"{r['updates'][0]:>8}  {','.join(r.get('malloc', ['?']))}")
    for privacy in dict.fromkeys(r["privacy"] for r in rows):
        ours = [r for r in rows if r["privacy"] == privacy and r["framework"] == "cluster_fl"
                and r["median_rate"]]
        peers = [r for r in rows if r["privacy"] == privacy and r["framework"] != "cluster_fl"
                 and r["median_rate"]]
        if ours and peers:
            a = max(ours, key=lambda r: r["median_rate"])
            b = max(peers, key=lambda r: r["median_rate"])
            prec = f" {b['precision']}" if b.get("precision") else ""
            lines.append(f"{privacy}: best cluster_fl ({a['procs']}p K={a['k']}) / best peer "
                         f"({b['framework']} {b['procs']}p{prec}) = "
                         f"{a['median_rate'] / b['median_rate']:.2f}x")
        k1 = {r["procs"]: r for r in ours if r["k"] == 1}
        for r in ours:
            if r["k"] != 1 and r["procs"] in k1:
                lines.append(f"{privacy}: cluster_fl {r['procs']}p K={r['k']} / K=1 = "
                             f"{r['median_rate'] / k1[r['procs']]['median_rate']:.2f}x")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
        return names
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frameworks", type=_names(FRAMEWORKS), default=list(FRAMEWORKS))
    ap.add_argument("--privacy", type=_names(PRIVACY), default=list(PRIVACY))
    ap.add_argument("--ks", type=_ints, default=[1, 4, 16],
                    help="cluster_fl fl.clients_per_step values with 1 process")
    ap.add_argument("--multi-ks", type=_ints, default=[1, 16],
                    help="cluster_fl fl.clients_per_step values with more than 1 rank")
    ap.add_argument("--ranks", type=_ints, default=[1, 2],
                    help="processes per run: cluster_fl ranks, pfl workers, Flower client workers")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after 1 warm-up)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    d = Work()
    ap.add_argument("--work", type=Path, default=Path(d.work_dir),
                    help="folder for the corpus, feature cache and run folders")
    ap.add_argument("--clients", type=int, default=d.clients, help="clients per round")
    ap.add_argument("--speakers-per-language", type=int, default=d.speakers_per_language,
                    help="private speakers per language (en, de): population = 2x this")
    ap.add_argument("--utterances", type=int, default=d.utterances, help="per client")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--local-steps", type=int, default=d.local_steps)
    ap.add_argument("--device", default=d.device,
                    help="cpu, or cuda / cuda:N: every framework trains on that one GPU")
    ap.add_argument("--peer-precision", choices=["best", "auto", "fp32", "bf16"],
                    default="best",
                    help="the peers' forward: best (default) = each peer measured in fp32 and "
                         "in bf16 autocast on a CPU (its faster one is compared), bf16 autocast "
                         "on a GPU; auto = bf16 on a GPU, fp32 on a CPU; fp32; bf16")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per cell")
    ap.add_argument("--json-out", type=Path, help="also write the JSON summary here")
    ap.add_argument("--peers-malloc", action="store_true",
                    help="give pfl and Flower the allocator cluster_fl preloads (default: "
                         "the system's, as their users run them)")
    ap.add_argument("--cell", help=argparse.SUPPRESS)       # internal: run one cell
    ap.add_argument("--work-json", help=argparse.SUPPRESS)  # internal: its Work
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell:
        cell = Cell(**json.loads(args.cell))
        print(json.dumps(run_cell(cell, Work.from_json(args.work_json))), flush=True)
        return 0
    try:
        work = Work(work_dir=str(args.work), speakers_per_language=args.speakers_per_language,
                    utterances=args.utterances, clients=args.clients,
                    batch_size=args.batch_size, local_steps=args.local_steps,
                    rounds=args.rounds, device=args.device)
    except ValueError as exc:
        print(f"bench.peers.run: {exc}", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prepare(work)
    cells = cells_for(args)
    runs: dict[Cell, list[dict]] = {c: [] for c in cells}
    for rep in range(args.reps):
        shift = rep % len(cells)
        for c in cells[shift:] + cells[:shift]:  # rotated: no cell always first or last
            res = run_cell_process(c, work, args.timeout, args.peers_malloc)
            runs[c].append(res)
            note = res["error"] if "error" in res else f"{res['rate']:.2f} updates/s"
            if "stderr_tail" in res:
                print(res["stderr_tail"], file=sys.stderr, flush=True)
            print(f"rep {rep + 1}/{args.reps} {c.label}: {note}", file=sys.stderr, flush=True)
    rows = summarise(cells, runs)
    print(table(rows, work, args.reps))
    summary = {"peers_bench": {"work": json.loads(work.to_json()), "reps": args.reps,
                               "versions": versions(), "cells": rows,
                               "bench_wall_s": round(time.perf_counter() - t0, 1)}}
    line = json.dumps(summary)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    print(line, flush=True)
    return 0 if all(r["median_rate"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Bench: cost of the secure-sum reduce against a plain float all-reduce of the same buffer.

Two gloo ranks on this machine (``cluster_fl.distributed.spawn``); for each size, in one run and side by
side: a float32 all-reduce (what non-secure FedAvg would send), a float64 all-reduce (same bytes as
int64), and ``SecureSummer.reduce`` in research (Philox masks) and secure (X25519 + ChaCha20 masks)
mode, which includes masking, the int64 all-reduce and decoding. The encoding of contributions
(``add``) is timed separately: it is per client, not per round. Median of ``--repeats``.

    /work/venv/bin/python bench/dist_secure_sum.py [--sizes 1e5 1e6 1e7] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster_fl.distributed import spawn
from cluster_fl.secure_sum import SecureSummer


def _timed(comm, op, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    # the slowest rank decides the round: take the max over ranks of each median
    return max(comm.all_gather_object(statistics.median(times)))


def bench_worker(comm, sizes: list[int], repeats: int) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for n in sizes:
        x = torch.rand(n, generator=torch.Generator().manual_seed(comm.rank)) * 2 - 1
        x32, x64 = x.clone(), x.double()  # reduced in place, repeatedly: only timing matters
        row = {
            "allreduce_f32": _timed(comm, lambda: comm.all_reduce_sum(x32), repeats),
            "allreduce_f64": _timed(comm, lambda: comm.all_reduce_sum(x64), repeats),
        }
        for mode in ("research", "secure"):
            s = SecureSummer({"u": n}, frac_bits=32, max_clients=1024, bounds=1.0, mode=mode)
            state = {"round": 0}

            def reduce_once() -> None:
                s.reduce(comm, state["round"])
                state["round"] += 1

            s.reduce(comm, 10**6)  # secure mode: key agreement once, outside the timing
            t_add = time.perf_counter()
            s.add({"u": x})
            row["add_per_client"] = time.perf_counter() - t_add
            row[f"secure_sum_{mode}"] = _timed(comm, reduce_once, repeats)
        out[n] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e5, 1e6, 1e7])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes]
    res = spawn(bench_worker, args.ranks, sizes, args.repeats, timeout_s=1800,
                comm_timeout_s=300)[0]
    print(f"{args.ranks} gloo ranks, {torch.get_num_threads()} threads here, 1 per rank; "
          f"median of {args.repeats}, slowest rank")
    print(f"{'floats':>10} {'f32 AR ms':>10} {'f64 AR ms':>10} {'research ms':>12} "
          f"{'secure ms':>10} {'res/f32':>8} {'sec/f32':>8} {'res/f64':>8} {'add ms':>8}")
    for n, r in res.items():
        f32, f64 = r["allreduce_f32"], r["allreduce_f64"]
        rs, ss = r["secure_sum_research"], r["secure_sum_secure"]
        print(f"{n:>10.0e} {1e3 * f32:>10.2f} {1e3 * f64:>10.2f} {1e3 * rs:>12.2f} "
              f"{1e3 * ss:>10.2f} {rs / f32:>8.2f} {ss / f32:>8.2f} {rs / f64:>8.2f} "
              f"{1e3 * r['add_per_client']:>8.2f}")


if __name__ == "__main__":
    main()

"""Local multi-process runs for tests and benches.

:func:`spawn` runs ``fn(comm, *args)`` in N local gloo processes and returns their results (a
child's exception fails the parent with the child's traceback); :func:`run_parity` and
:func:`bitwise_differences` compare a 1-process run with N-process runs (pfl-research's check).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import struct
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from cluster_fl.distributed.comm import Comm, LocalComm, init_comm

@dataclass
class RankFailure:
    """A rank that raised, died or ran out of wall time (``spawn(raise_on_error=False)``)."""

    rank: int
    exitcode: int | None
    error: str  # the child's traceback, or why it has none


class SpawnError(RuntimeError):
    """A spawned rank failed; the message carries its traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, comm_timeout_s: int,
           threads: int, use_fake: bool, results: Any, args: tuple,
           wait_timeout_s: int | None = None) -> None:
    comm: Comm | None = None
    try:
        torch.set_num_threads(threads)
        env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        os.environ.update(env)
        comm = LocalComm() if use_fake else init_comm(comm_timeout_s, "gloo", env,
                                                      wait_timeout_s=wait_timeout_s)
        out = fn(comm, *args)
        # plain pickle bytes: torch's queue reducers would share tensors through file
        # descriptors that die with this process
        results.put((rank, True, pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException:  # noqa: BLE001 -- everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if comm is not None:
            try:
                comm.close()
            except Exception:  # noqa: BLE001 -- closing after a failure may fail too
                pass


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
          comm_timeout_s: int = 30, threads: int = 1, use_fake: bool = False,
          raise_on_error: bool = True, wait_timeout_s: int | None = None) -> list[Any]:
    """Run ``fn(comm, *args)`` in ``world_size`` fresh processes (gloo on a free localhost port,
    or :class:`LocalComm` when ``use_fake`` and world size 1) and return the results by rank.
    ``fn`` and its results must pickle. A child's exception raises :class:`SpawnError` with its
    traceback (or, with ``raise_on_error=False``, appears as a :class:`RankFailure`); everything
    is killed after ``timeout_s`` seconds of wall time."""
    if use_fake and world_size != 1:
        raise ValueError("use_fake needs world_size 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, daemon=True, args=(
        fn, r, world_size, port, comm_timeout_s, threads, use_fake, results, args,
        wait_timeout_s))
        for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        def take(timeout: float) -> None:
            """Record one rank's report (raises queue.Empty when none arrives in time)."""
            rank, ok, value = results.get(timeout=timeout)
            out[rank] = pickle.loads(value) if ok else RankFailure(rank, None, value)
            if not ok and raise_on_error:
                raise SpawnError(f"rank {rank} of {world_size} failed:\n{value}")

        while len(out) < world_size:
            try:
                take(0.1)
                continue
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):  # died without reporting (segfault, os._exit, OOM)
                if r not in out and not p.is_alive() and p.exitcode is not None:
                    try:  # its report may still be in flight
                        take(1.0)
                        break
                    except queue_mod.Empty:
                        out[r] = RankFailure(r, p.exitcode, f"exited with code {p.exitcode} "
                                             "without a result")
                        if raise_on_error:
                            raise SpawnError(f"rank {r} of {world_size} {out[r].error}")
            if time.monotonic() > deadline:
                for r in range(world_size):
                    out.setdefault(r, RankFailure(r, None, f"no result within {timeout_s} s"))
                if raise_on_error:
                    raise SpawnError(f"ranks did not finish within {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [out[r] for r in range(world_size)]


# --------------------------------------------------------------------------- parity checks

def run_parity(fn: Callable[..., Any], *args: Any, world_sizes: Sequence[int] = (1, 2),
               timeout_s: float = 120.0, comm_timeout_s: int = 30) -> dict[int, list[Any]]:
    """pfl-research's 1-vs-N-process check: ``fn(comm, *args)`` with the single-process fake
    (world size 1, in a fresh process) and with real gloo groups of the other sizes. Returns
    ``{world_size: [result per rank]}``; compare with :func:`bitwise_differences`."""
    return {n: spawn(fn, n, *args, timeout_s=timeout_s, comm_timeout_s=comm_timeout_s,
                     use_fake=(n == 1)) for n in world_sizes}


def bitwise_differences(a: Any, b: Any, path: str = "", limit: int = 20) -> list[str]:
    """Where ``a`` and ``b`` differ bit for bit (tensors: dtype, shape and bytes; floats: their
    IEEE bits, so -0.0 != 0.0 and NaN == NaN of the same payload), recursing into dicts, lists,
    tuples and dataclass-like ``__dict__``s. Empty list = identical."""
    diffs: list[str] = []

    def walk(x: Any, y: Any, p: str) -> None:
        if len(diffs) >= limit:
            return
        if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
            x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(
                np.ascontiguousarray(y))
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                diffs.append(f"{p}: tensor vs {type(y if isinstance(x, torch.Tensor) else x)}")
            elif x.dtype != y.dtype or x.shape != y.shape:
                diffs.append(f"{p}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
            else:
                xb = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                yb = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                if not torch.equal(xb, yb):
                    n = int((x.detach().cpu() != y.detach().cpu()).sum())
                    diffs.append(f"{p}: {n} of {x.numel()} elements differ")
        elif isinstance(x, Mapping) and isinstance(y, Mapping):
            if set(x) != set(y):
                diffs.append(f"{p}: keys differ: {sorted(map(str, set(x) ^ set(y)))}")
            for k in x:
                if k in y:
                    walk(x[k], y[k], f"{p}[{k!r}]")
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if type(x) is not type(y) or len(x) != len(y):
                diffs.append(f"{p}: {type(x).__name__}[{len(x)}] vs {type(y).__name__}[{len(y)}]")
            else:
                for i, (xi, yi) in enumerate(zip(x, y)):
                    walk(xi, yi, f"{p}[{i}]")
        elif isinstance(x, float) and isinstance(y, float):
            if struct.pack("<d", x) != struct.pack("<d", y):
                diffs.append(f"{p}: {x!r} vs {y!r}")
        elif hasattr(x, "__dict__") and type(x) is type(y) and not callable(x):
            walk(vars(x), vars(y), p)
        elif type(x) is not type(y) or x != y:
            diffs.append(f"{p}: {x!r} vs {y!r}")

    walk(a, b, path or "result")
    return diffs

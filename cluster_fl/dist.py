"""The process boundary: the only module that imports ``torch.distributed``.

Algorithms talk to a :class:`Comm` (fairseq2's "Gang" idea): :class:`TorchComm` wraps a real
process group (gloo on CPU, NCCL on GPU) and :class:`LocalComm` is the single-process fake with
identical semantics for world size 1. :func:`init_comm` reads the launcher's environment (torchrun
first, then SLURM, else the fake) and sets a collective timeout, so a dead or stuck rank fails the
job within ``timeout_s`` instead of hanging it.

For tests and benches, :func:`spawn` runs ``fn(comm, *args)`` in N local gloo processes and returns
their results (a child's exception fails the parent with the child's traceback), and
:func:`run_parity` + :func:`bitwise_differences` compare a 1-process run with N-process runs.
"""

from __future__ import annotations

import abc

import datetime
import math
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import re
import socket
import struct
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as tdist


class CommError(RuntimeError):
    """A collective failed: a peer died, or did not answer within the collective timeout."""


class Comm(abc.ABC):
    """What rank code may use. ``all_reduce_sum`` and ``broadcast`` work in place and return the
    tensor; object collectives pickle. Every rank must call every collective in the same order."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str = "local"

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the rank that logs, adds noise and writes files)."""
        return self.rank == 0

    @abc.abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; returns it."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s, in place; returns it."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s picklable ``obj`` on every rank."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait for every rank."""

    def close(self) -> None:
        """Release the process group (idempotent)."""


class LocalComm(Comm):
    """World size 1, no process group: every collective is the identity. Used when no launcher
    variables are set, and as the fake in tests (same results as a 1-rank real group)."""

    backend = "local"

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        _check_src(src, 1)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        _check_src(src, 1)
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


FakeComm = LocalComm


def _check_src(src: int, world_size: int) -> None:
    if not 0 <= src < world_size:
        raise ValueError(f"src rank {src} outside [0, {world_size})")


class TorchComm(Comm):
    """A real ``torch.distributed`` process group. With NCCL, CPU tensors are staged through the
    rank's GPU so callers never care where the collective runs."""

    def __init__(self, *, rank: int, world_size: int, local_rank: int, local_world_size: int,
                 backend: str, timeout_s: int):
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.backend, self.timeout_s = backend, timeout_s
        self.device = (torch.device("cuda", local_rank) if backend == "nccl"
                       else torch.device("cpu"))
        self._closed = False

    def _run(self, what: str, op: Callable[[], Any]) -> Any:
        # Turn backend errors (gloo "Connection closed by peer", timeouts) into one clear error.
        try:
            return op()
        except (RuntimeError, tdist.DistError) as exc:  # DistError subclasses RuntimeError
            raise CommError(f"rank {self.rank}/{self.world_size}: collective {what} failed "
                            f"(a peer died or did not answer within {self.timeout_s} s): "
                            f"{exc}") from exc

    def _staged(self, tensor: torch.Tensor, op: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        if tensor.device == self.device:
            op(tensor)
            return tensor
        moved = tensor.to(self.device)
        op(moved)
        tensor.copy_(moved)
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._run("all_reduce", lambda: self._staged(
            tensor, lambda t: tdist.all_reduce(t, op=tdist.ReduceOp.SUM)))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        _check_src(src, self.world_size)
        return self._run("broadcast", lambda: self._staged(
            tensor, lambda t: tdist.broadcast(t, src=src)))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        _check_src(src, self.world_size)
        box = [obj if self.rank == src else None]
        self._run("broadcast_object", lambda: tdist.broadcast_object_list(box, src=src))
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", lambda: tdist.all_gather_object(out, obj))
        return out

    def barrier(self) -> None:
        if self.backend == "gloo":
            # monitored_barrier names the rank that failed to arrive.
            self._run("barrier", lambda: tdist.monitored_barrier(
                timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True))
        else:
            self._run("barrier", lambda: tdist.barrier())

    def close(self) -> None:
        if not self._closed and tdist.is_initialized():
            tdist.destroy_process_group()
        self._closed = True


# --------------------------------------------------------------------------- launcher environment

@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, read from torchrun or SLURM variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5.
    Zero padding follows the range start; several bracket groups in one name multiply out."""
    hosts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"bad SLURM node list {nodelist!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            item = nodelist[start:i].strip()
            if item:
                hosts.extend(_expand_host(item, nodelist))
            start = i + 1
    if depth != 0:
        raise ValueError(f"bad SLURM node list {nodelist!r}: unbalanced '['")
    return hosts


def _expand_host(item: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    values: list[str] = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad SLURM node list {whole!r}: range {part!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"bad SLURM node list {whole!r}: descending range {part!r}")
        values.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
    head, tail = item[:m.start()], item[m.end():]
    return [h for v in values for h in _expand_host(head + v + tail, whole)]


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` -> tasks on node ``node_id``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"bad SLURM tasks-per-node value {tasks_per_node!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


def slurm_port(job_id: str | int) -> int:
    """A port in [20000, 40000) derived from the job id, so every task of a job agrees on it."""
    return 20000 + int(job_id) % 20000


def env_from_torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    """torchrun (or any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return LaunchEnv(rank=int(env["RANK"]), world_size=world,
                     local_rank=int(env.get("LOCAL_RANK", 0)),
                     local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
                     master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                     master_port=int(env.get("MASTER_PORT", 29500)), source="torchrun")


def env_from_slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    """One process per SLURM task (``srun python -m cluster_fl ...``)."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand_nodelist(nodelist) if nodelist else []
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    if "MASTER_PORT" in env:
        port = int(env["MASTER_PORT"])
    elif "SLURM_JOB_ID" in env:
        port = slurm_port(env["SLURM_JOB_ID"])
    else:
        port = 29500
    world = int(env["SLURM_NTASKS"])
    if "SLURM_NTASKS_PER_NODE" in env:
        local_world = _tasks_on_node(env["SLURM_NTASKS_PER_NODE"], 0)
    elif "SLURM_TASKS_PER_NODE" in env:
        local_world = _tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env.get("SLURM_NODEID", 0)))
    else:
        local_world = max(1, math.ceil(world / max(1, len(hosts))))
    return LaunchEnv(rank=int(env["SLURM_PROCID"]), world_size=world,
                     local_rank=int(env.get("SLURM_LOCALID", 0)), local_world_size=local_world,
                     master_addr=addr, master_port=port, source="slurm")


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """torchrun variables win (``srun torchrun`` sets both), then SLURM, else ``None``."""
    env = os.environ if env is None else env
    return env_from_torchrun(env) or env_from_slurm(env)


def init_comm(timeout_s: int, backend: str | None = None,
              env: Mapping[str, str] | None = None) -> Comm:
    """The run's communicator. No launcher variables -> :class:`LocalComm`; otherwise a process
    group (``backend`` default: NCCL when CUDA is available, else gloo) whose collectives raise
    :class:`CommError` after ``timeout_s`` seconds. NCCL's own watchdog (on by default since
    torch 2.2) aborts a rank stuck past the same timeout."""
    if timeout_s < 1:
        raise ValueError(f"timeout_s must be >= 1, got {timeout_s}")
    launch = detect_launch(env)
    if launch is None:
        return LocalComm()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    comm = TorchComm(rank=launch.rank, world_size=launch.world_size,
                     local_rank=launch.local_rank, local_world_size=launch.local_world_size,
                     backend=backend, timeout_s=timeout_s)
    if tdist.is_initialized():  # someone (a launcher wrapper) set it up already: reuse it
        return comm
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
        kwargs["device_id"] = comm.device
    tdist.init_process_group(
        backend=backend, init_method=f"tcp://{_url_host(launch.master_addr)}:{launch.master_port}",
        rank=launch.rank, world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return comm


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


# --------------------------------------------------------------------------- local launcher

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
           threads: int, use_fake: bool, results: Any, args: tuple) -> None:
    comm: Comm | None = None
    try:
        torch.set_num_threads(threads)
        env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        os.environ.update(env)
        comm = LocalComm() if use_fake else init_comm(comm_timeout_s, "gloo", env)
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
          raise_on_error: bool = True) -> list[Any]:
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
        fn, r, world_size, port, comm_timeout_s, threads, use_fake, results, args))
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

"""Communicators: what rank code may use to talk to other ranks.

Algorithms talk to a :class:`Comm` (fairseq2's "Gang" idea): :class:`TorchComm` wraps a real
process group (gloo on CPU, NCCL on GPU) and :class:`LocalComm` is the single-process fake with
identical semantics for world size 1. :func:`init_comm` reads the launcher's environment
(:mod:`cluster_fl.distributed.launch`) and sets up two kinds of waiting:

* ``timeout_s`` (``run.timeout_s``) -- dead-peer detection: short collectives (broadcast of the
  noised sum, stop-flag agreement, barriers) fail after this long;
* ``wait_timeout_s`` (``run.wait_timeout_s``) -- collectives marked ``slow=True`` wait for the
  slowest lane to finish its shard of the cohort or of the evaluation. They run on a second
  process group with the long limit, so a slow rank never fails a healthy job. A rank that dies
  still fails them at once: gloo and NCCL see the closed connection, not the timeout.
"""

from __future__ import annotations

import abc
import datetime
from typing import Any, Callable, Mapping

import torch
import torch.distributed as tdist

from cluster_fl.distributed.launch import detect_launch, device_index


class CommError(RuntimeError):
    """A collective failed: a peer died, or did not answer within the collective timeout."""


class Comm(abc.ABC):
    """What rank code may use. ``all_reduce_sum`` and ``broadcast`` work in place and return the
    tensor; object collectives pickle. Every rank must call every collective in the same order.
    ``slow=True`` marks a collective that waits for the slowest rank's training or evaluation: it
    gets the long limit (``wait_timeout_s``) instead of the dead-peer limit."""

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
    def all_reduce_sum(self, tensor: torch.Tensor, *, slow: bool = False) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; returns it."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s, in place; returns it."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s picklable ``obj`` on every rank."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any, *, slow: bool = False) -> list[Any]:
        """Every rank's ``obj``, indexed by rank."""

    @abc.abstractmethod
    def barrier(self, *, slow: bool = False) -> None:
        """Wait for every rank."""

    def close(self) -> None:
        """Release the process group (idempotent)."""


class LocalComm(Comm):
    """World size 1, no process group: every collective is the identity. Used when no launcher
    variables are set, and as the fake in tests (same results as a 1-rank real group)."""

    backend = "local"

    def all_reduce_sum(self, tensor: torch.Tensor, *, slow: bool = False) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        _check_src(src, 1)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        _check_src(src, 1)
        return obj

    def all_gather_object(self, obj: Any, *, slow: bool = False) -> list[Any]:
        return [obj]

    def barrier(self, *, slow: bool = False) -> None:
        return None


def _check_src(src: int, world_size: int) -> None:
    if not 0 <= src < world_size:
        raise ValueError(f"src rank {src} outside [0, {world_size})")


class TorchComm(Comm):
    """A real ``torch.distributed`` process group. With NCCL, CPU tensors are staged through the
    rank's GPU so callers never care where the collective runs. Collectives marked ``slow`` run
    on a second group of the same ranks whose timeout is ``wait_timeout_s``."""

    def __init__(self, *, rank: int, world_size: int, local_rank: int, local_world_size: int,
                 backend: str, timeout_s: int, wait_timeout_s: int | None = None):
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.backend, self.timeout_s = backend, timeout_s
        self.wait_timeout_s = max(timeout_s, wait_timeout_s or timeout_s)
        self.device = (torch.device("cuda", device_index(local_rank, local_world_size,
                                                         torch.cuda.device_count()))
                       if backend == "nccl" else torch.device("cpu"))
        self._slow_group: Any = None  # made by make_groups(), right after the process group
        self._closed = False

    def make_groups(self) -> None:
        """Create the second group (same ranks, the long limit). Collective: called by
        :func:`init_comm` while every rank is known to be alive -- made lazily, a rank that died
        before its first slow collective would leave its peers waiting in group creation."""
        if self.wait_timeout_s > self.timeout_s and self._slow_group is None:
            self._slow_group = tdist.new_group(
                backend=self.backend, timeout=datetime.timedelta(seconds=self.wait_timeout_s))

    def _group(self, slow: bool) -> Any:
        return self._slow_group if slow else None  # None: the default group

    def _run(self, what: str, op: Callable[[], Any], slow: bool = False) -> Any:
        # Turn backend errors (gloo "Connection closed by peer", timeouts) into one clear error.
        try:
            return op()
        except (RuntimeError, tdist.DistError) as exc:  # DistError subclasses RuntimeError
            limit = self.wait_timeout_s if slow else self.timeout_s
            raise CommError(f"rank {self.rank}/{self.world_size}: collective {what} failed "
                            f"(a peer died or did not answer within {limit} s): "
                            f"{exc}") from exc

    def _staged(self, tensor: torch.Tensor, op: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        if tensor.device == self.device:
            op(tensor)
            return tensor
        moved = tensor.to(self.device)
        op(moved)
        tensor.copy_(moved)
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor, *, slow: bool = False) -> torch.Tensor:
        group = self._group(slow)
        return self._run("all_reduce", lambda: self._staged(
            tensor, lambda t: tdist.all_reduce(t, op=tdist.ReduceOp.SUM, group=group)), slow)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        _check_src(src, self.world_size)
        return self._run("broadcast", lambda: self._staged(
            tensor, lambda t: tdist.broadcast(t, src=src)))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        _check_src(src, self.world_size)
        box = [obj if self.rank == src else None]
        self._run("broadcast_object", lambda: tdist.broadcast_object_list(box, src=src))
        return box[0]

    def all_gather_object(self, obj: Any, *, slow: bool = False) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        group = self._group(slow)
        self._run("all_gather_object", lambda: tdist.all_gather_object(out, obj, group=group),
                  slow)
        return out

    def barrier(self, *, slow: bool = False) -> None:
        limit = self.wait_timeout_s if slow else self.timeout_s
        if self.backend == "gloo":
            # monitored_barrier names the rank that failed to arrive.
            self._run("barrier", lambda: tdist.monitored_barrier(
                group=self._group(slow), timeout=datetime.timedelta(seconds=limit),
                wait_all_ranks=True), slow)
        else:
            self._run("barrier", lambda: tdist.barrier(group=self._group(slow)), slow)

    def close(self) -> None:
        if not self._closed and tdist.is_initialized():
            tdist.destroy_process_group()
        self._closed = True


# --------------------------------------------------------------------------- set-up

def init_comm(timeout_s: int, backend: str | None = None,
              env: Mapping[str, str] | None = None, wait_timeout_s: int | None = None) -> Comm:
    """The run's communicator. No launcher variables -> :class:`LocalComm`; otherwise a process
    group (``backend`` default: NCCL when CUDA is available, else gloo) whose collectives raise
    :class:`CommError` after ``timeout_s`` seconds (``wait_timeout_s`` for ``slow`` ones). NCCL's
    own watchdog (on by default since torch 2.2) aborts a rank stuck past the same limit."""
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
                     backend=backend, timeout_s=timeout_s, wait_timeout_s=wait_timeout_s)
    if tdist.is_initialized():  # someone (a launcher wrapper) set it up already: reuse it
        comm.make_groups()
        return comm
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(comm.device)
        kwargs["device_id"] = comm.device
    tdist.init_process_group(
        backend=backend, init_method=f"tcp://{_url_host(launch.master_addr)}:{launch.master_port}",
        rank=launch.rank, world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    comm.make_groups()
    return comm


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr

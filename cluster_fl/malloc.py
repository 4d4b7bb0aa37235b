"""A faster ``malloc`` for every cluster-fl process: jemalloc or tcmalloc, preloaded when found.

A CPU client step makes ~12,000 tensor allocations a round (compiled graphs' buffers, autograd,
the optimiser); glibc's allocator serves them slowly. Preloaded, jemalloc or tcmalloc made a
steady round 1.1-1.35x faster on one core (the benchmark's work 1.25x side by side, a study
cell 1.12x), with bit-identical results (results/LOG.md, 2026-12-05). Neither ships with pip,
and a library can only replace ``malloc`` before the process starts, so the entry point
(:func:`cluster_fl.cli.main`) puts the library in ``LD_PRELOAD`` and re-executes itself once;
the ranks, grid jobs and workers it starts inherit it.

``CLUSTER_FL_MALLOC``: ``auto`` (default: the first of :data:`LIBRARIES` found in the usual
library folders, else the system's), ``system`` (leave ``malloc`` alone), or a library's path.
A ``LD_PRELOAD`` that already names an allocator is left as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, MutableMapping

from cluster_fl.errors import UserError

ENV = "CLUSTER_FL_MALLOC"
LIBRARIES = ("libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
            "/usr/local/lib", "/usr/lib", "/lib/x86_64-linux-gnu", "/lib64")


def find_malloc(env: Mapping[str, str], folders: tuple[str, ...] | None = None) -> str | None:
    """The allocator library ``env`` asks for (:data:`ENV`), or None for the system's."""
    choice = env.get(ENV, "auto").strip() or "auto"
    if choice == "system":
        return None
    if choice != "auto":
        if not Path(choice).is_file():
            raise UserError(f"{ENV}={choice}: no such library (auto, system, or a file's path)")
        return choice
    if not sys.platform.startswith("linux"):
        return None
    if folders is None:  # a conda or virtual environment's own lib/ first, then the system's
        folders = tuple(f"{p}/lib" for p in (env.get("CONDA_PREFIX"), sys.prefix) if p) + _FOLDERS
    for name in LIBRARIES:
        for folder in folders:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    return None


def preload_malloc(env: MutableMapping[str, str], folders: tuple[str, ...] | None = None
                   ) -> str | None:
    """Put the allocator :func:`find_malloc` picks first in ``env``'s ``LD_PRELOAD``; returns it,
    or None when there is nothing to do (none found, ``system``, or an allocator is already
    preloaded). The caller re-executes itself for the library to take effect in its own
    process; processes it starts get it from ``env``."""
    preloaded = env.get("LD_PRELOAD", "")
    if any(name in preloaded for name in _ALLOCATORS):
        return None
    lib = find_malloc(env, folders)
    if lib is not None:
        env["LD_PRELOAD"] = f"{lib}:{preloaded}" if preloaded else lib
    return lib


def reexec_with_malloc() -> None:
    """Re-execute this process (same interpreter, same arguments) with the allocator
    :func:`preload_malloc` adds to ``LD_PRELOAD``; returns when there is nothing to add. A
    process's entry point calls it first: a library replaces ``malloc`` only in a new image."""
    if preload_malloc(os.environ):
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def active_malloc() -> str:
    """The allocator this process runs on: a preloaded library's name, or ``system``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    for line in maps.splitlines():
        name = os.path.basename(line.rsplit(" ", 1)[-1])
        if any(a in name for a in _ALLOCATORS):
            return name
    return "system"

"""The one entry point, ``cluster-fl``: parses the sub-command and hands over to its module.

Every command is a module of :mod:`cluster_fl.commands` (``cluster-fl make-corpus`` is
``cluster_fl/commands/make_corpus.py``) exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported lazily so ``cluster-fl account`` does not pay for
importing transformers. A :class:`~cluster_fl.errors.UserError` (bad config key, missing file,
...) becomes one line on stderr and exit code 2 -- never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import MutableMapping

from cluster_fl.errors import UserError
from cluster_fl.malloc import reexec_with_malloc

# command -> one-line help; the implementation is cluster_fl.commands.<command with _ for ->
COMMANDS: dict[str, str] = {
    "demo": "the embedded default, end to end, on CPU",
    "train": "one experiment (single process or under torchrun)",
    "grid": "expand a grid and submit it (local|slurm|debug)",
    "status": "done / running / failed per cell of a grid",
    "table": "multi-seed tables from results folders",
    "plot": "figures from results folders",
    "calibrate": "norm probe on public data -> alpha",
    "plan": "per-GPU memory of a config; smallest lane size G",
    "account": "epsilon for a config; sigma for a target epsilon",
    "thresholds": "per-group thresholds, per-pool sigma",
    "make-corpus": "synthetic multilingual corpus (MLS layout)",
    "features": "compute a config's log-mel features into the store",
    "pretrain": "central public pretraining of a tiny model",
    "audit": "the privacy audit of a run folder",
    "dump-config": "print the resolved config",
}


def command_module(command: str) -> str:
    """The module implementing ``command``."""
    return "cluster_fl.commands." + command.replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cluster-fl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_command=name)
    return parser


SPINCOUNT = "10000"  # libgomp's default spins ~300,000 times before a waiting thread sleeps


def bound_openmp_spin(env: MutableMapping[str, str]) -> bool:
    """Cap how long torch's OpenMP threads spin for work before sleeping (``GOMP_SPINCOUNT``),
    unless the user set a wait policy; True when it set the cap. libgomp reads it when torch
    loads, so :func:`main` calls this first; the ranks and jobs it starts inherit it. With a
    core taken by another process, 2-thread pretraining spent its time spinning: 150 steps took
    221 s at libgomp's default, 90 s capped, 33 s vs 32.7 s on an idle machine (LOG, session 14).
    """
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env or "torch" in sys.modules:
        return False
    env["GOMP_SPINCOUNT"] = SPINCOUNT
    return True


def main(argv: list[str] | None = None) -> int:
    bound_openmp_spin(os.environ)
    if argv is None:  # the process's entry point (not a test calling main): a faster malloc
        try:
            reexec_with_malloc()
        except UserError as exc:
            print(f"cluster-fl: error: {exc}", file=sys.stderr)
            return 2
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Parse the command first, then let its module declare its own arguments.
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help / usage error (exit 2)
        parser.print_help()
        return 2
    command = argv[0]
    module = importlib.import_module(command_module(command))
    sub = argparse.ArgumentParser(prog=f"cluster-fl {command}", description=COMMANDS[command])
    module.add_arguments(sub)
    args = sub.parse_intermixed_args(argv[1:])
    args.command = command
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        print(f"cluster-fl {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cluster-fl {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

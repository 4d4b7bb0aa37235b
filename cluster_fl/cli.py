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
import signal
import sys
from typing import MutableMapping

from cluster_fl.errors import PREEMPTED_EXIT, UserError
from cluster_fl.malloc import reexec_with_malloc

# command -> one-line help; the implementation is cluster_fl.commands.<command with _ for ->
COMMANDS: dict[str, str] = {
    "demo": "the embedded default, end to end, on CPU",
    "train": "one experiment (single process or under torchrun)",
    "grid": "expand a grid and submit it (local|slurm|debug)",
    "status": "how far each run of a grid is (round, ETA, epsilon, WER) and why one failed",
    "table": "WER tables (mean over seeds, CIs, paired tests) from results folders",
    "plot": "figures (WER per round, norms, clip rates) from results folders",
    "calibrate": "measure encoder and decoder update norms on public data; recommend alpha",
    "plan": "the GPU memory a config needs; the fewest GPUs per client lane",
    "account": "epsilon for a config; sigma for a target epsilon",
    "thresholds": "the clipping threshold of each layer and the noise of each pool",
    "make-corpus": "synthetic multilingual corpus (MLS layout)",
    "features": "compute a config's log-mel features into the store",
    "pretrain": "central public pretraining of a tiny model",
    "audit": "the privacy audit of a run folder",
    "export": "a run's LoRA as a PEFT adapter (+ safetensors, model card)",
    "dump-config": "print the resolved config",
}


def command_module(command: str) -> str:
    """The module implementing ``command``."""
    return "cluster_fl.commands." + command.replace("-", "_")


DESCRIPTION = """\
Federated fine-tuning of speech-LLMs (audio encoder -> connector -> LLM decoder, LoRA) under
central differential privacy, with component-aware clipping (alpha-split: the encoder and the
decoder get their own share of the clipping budget)."""

EPILOG = """\
getting started:
  cluster-fl demo                           the embedded default on CPU, end to end (~10 min)
  cluster-fl train CONFIG [key=value ...]   one experiment; configs/ holds presets
  cluster-fl grid GRID --cluster slurm      a grid of experiments on a SLURM cluster
  cluster-fl status GRID                    how far each run is (round, ETA, epsilon, WER)
  cluster-fl table RESULTS                  the multi-seed table of a results folder
  cluster-fl export RUN OUT                 the trained adapters, loadable with PEFT

'cluster-fl COMMAND --help' describes a command; docs/ holds the guides and the config
reference (docs/config.md)."""


def version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("cluster_fl")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        from cluster_fl import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cluster-fl", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
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
    221 s at libgomp's default, 90 s capped, 33 s vs 32.7 s on an idle machine (LOG, 2026-12-05).
    """
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env or "torch" in sys.modules:
        return False
    env["GOMP_SPINCOUNT"] = SPINCOUNT
    return True


def stop_before_start(signum: int, _frame: object) -> None:
    """A stop signal before ``train`` has installed its own handlers (the interpreter and the
    command's imports): nothing has started, nothing is lost -- exit 75 (resubmit), not 143."""
    print(f"cluster-fl: stopped by {signal.Signals(signum).name} before the run started; "
          "nothing to save, resubmit to run", file=sys.stderr, flush=True)
    raise SystemExit(PREEMPTED_EXIT)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    previous = {}
    if args_in[:1] == ["train"]:  # first thing: a SIGTERM from here on is a clean stop
        for s in (signal.SIGTERM, signal.SIGUSR2):
            try:
                previous[s] = signal.signal(s, stop_before_start)
            except ValueError:  # not the main thread: the caller owns the signals
                pass
    try:
        return _main(argv)
    finally:
        # called in a process that goes on (a test): leave it as it was -- unless the command
        # has since ignored the signal (a stopped run: a second SIGTERM must not end it)
        for s, handler in previous.items():
            if argv is not None and signal.getsignal(s) is stop_before_start:
                signal.signal(s, handler)


def _main(argv: list[str] | None) -> int:
    bound_openmp_spin(os.environ)
    if argv is None:  # the process's entry point (not a test calling main): a faster malloc
        try:
            reexec_with_malloc()
        except UserError as exc:
            print(f"cluster-fl: error: {exc}", file=sys.stderr)
            return 2
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["--version"]:
        print(f"cluster-fl {version()}")
        return 0
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

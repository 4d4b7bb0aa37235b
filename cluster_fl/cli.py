"""The one entry point, ``cluster-fl``: parses the sub-command and hands over to its module.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; modules are
imported lazily so ``cluster-fl account`` does not pay for importing transformers. A
:class:`~cluster_fl.errors.UserError` (bad config key, missing file, ...) becomes one line on
stderr and exit code 2 -- never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cluster_fl.errors import UserError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("cluster_fl.engine.demo", "the embedded default, end to end, on CPU"),
    "train": ("cluster_fl.engine.train", "one experiment (single process or under torchrun)"),
    "grid": ("cluster_fl.experiments.grid", "expand a grid and submit it (local|slurm|debug)"),
    "status": ("cluster_fl.experiments.status", "done / running / failed per cell of a grid"),
    "table": ("cluster_fl.experiments.table", "multi-seed tables from results folders"),
    "plot": ("cluster_fl.experiments.plot", "figures from results folders"),
    "calibrate": ("cluster_fl.experiments.calibrate", "norm probe on public data -> alpha"),
    "plan": ("cluster_fl.experiments.plan", "per-GPU memory of a config; smallest lane size G"),
    "account": ("cluster_fl.privacy.commands", "epsilon for a config; sigma for a target epsilon"),
    "thresholds": ("cluster_fl.privacy.commands", "per-group thresholds, per-pool sigma"),
    "make-corpus": ("cluster_fl.data.corpus", "synthetic multilingual corpus (MLS layout)"),
    "pretrain": ("cluster_fl.training.pretrain", "central public pretraining of a tiny model"),
    "audit": ("cluster_fl.audit.commands", "the privacy audit of a run folder"),
    "dump-config": ("cluster_fl.cli", "print the resolved config"),
}


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The shared ``CONFIG [key=value ...]`` positional arguments."""
    parser.add_argument("config", nargs=None if required else "?", help="YAML preset")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def add_arguments(parser: argparse.ArgumentParser) -> None:  # dump-config
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:  # dump-config
    from cluster_fl.config import dump_config, load_config

    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cluster-fl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module_name, _command=name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Parse the command first, then let its module declare its own arguments.
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help / usage error (exit 2)
        parser.print_help()
        return 2
    command = argv[0]
    module = importlib.import_module(COMMANDS[command][0])
    sub = argparse.ArgumentParser(prog=f"cluster-fl {command}", description=COMMANDS[command][1])
    if hasattr(module, "add_arguments_for"):
        module.add_arguments_for(command, sub)
    else:
        module.add_arguments(sub)
    args = sub.parse_intermixed_args(argv[1:])
    args.command = command
    try:
        runner = getattr(module, "run_for", None)
        return int((runner(command, args) if runner else module.run(args)) or 0)
    except UserError as exc:
        print(f"cluster-fl {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cluster-fl {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

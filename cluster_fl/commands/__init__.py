"""The command layer: one module per ``cluster-fl`` command, the top of the house.

``cluster_fl.cli`` parses the command name and hands over to ``cluster_fl.commands.<name>``; each
module declares its arguments (``add_arguments(parser)``) and runs the command
(``run(args) -> exit code``), assembling what the layers below provide -- experiments and the
engine, privacy, models and data. Nothing below this package imports it or the CLI (a test in
``tests/test_architecture.py`` holds that rule); errors meant for the user are
:class:`cluster_fl.errors.UserError`, which the CLI prints as one line with exit code 2.
See ARCHITECTURE.md for the layers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The shared ``CONFIG [key=value ...]`` positional arguments."""
    parser.add_argument("config", nargs=None if required else "?", help="YAML preset")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def load_checked(config: str | None, overrides: list[str]) -> Any:
    """A command's config: the preset and overrides read and checked against the model it names
    (``data.n_mels`` from the model, a contradiction refused naming both values: exit 2)."""
    from cluster_fl.config import load_config
    from cluster_fl.models.registry import resolve_shapes

    return resolve_shapes(load_config(config, overrides))


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """``CONFIG [key=value ...] [--json]``: the arguments of a command that prints a report of a
    config (``account``, ``thresholds``)."""
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the JSON contract")


def print_report(args: argparse.Namespace, report: Callable[[Any], dict[str, Any]],
                 formatted: Callable[[dict[str, Any]], str]) -> int:
    """Load the config of ``args``, build its report and print it as JSON (``--json``, strict:
    no NaN) or as text; exit code 0."""
    result = report(load_checked(args.config, args.overrides))
    print(json.dumps(result, indent=2, default=str, allow_nan=False) if args.json
          else formatted(result))
    return 0

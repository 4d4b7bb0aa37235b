"""``cluster-fl dump-config CONFIG [key=value ...]``: print the resolved config as YAML."""

from __future__ import annotations

import argparse

from cluster_fl.commands import add_config_arguments, load_checked
from cluster_fl.config import dump_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    print(dump_config(load_checked(args.config, args.overrides)), end="")
    return 0

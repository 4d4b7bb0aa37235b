"""``cluster-fl features CONFIG [key=value ...] [--part i/n]``: fill the features store.

Computes the log-mel features of every language and split a config reads (its client and
evaluation splits) into the store of :mod:`cluster_fl.data.store`: per speaker, an index per
shard, keyed by content and the feature parameters. Idempotent and resumable (a part written
is never computed again while its audio and parameters hold; files are written atomically, so a
killed job leaves only whole files), and a second call does no work. ``--part i/n`` takes every
n-th work item from the i-th (0-based): the SLURM array job ``grid`` submits runs one per task.
CONFIG may be a grid file: the stores of its cells' distinct data settings are filled (cells
differ in mel bins when their models do).
"""

from __future__ import annotations

import argparse
import sys

from cluster_fl.commands import add_config_arguments, load_checked
from cluster_fl.errors import UserError


def parse_part(text: str) -> tuple[int, int]:
    """``i/n`` -> (i, n) with 0 <= i < n; a :class:`UserError` otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--part: expected i/n (e.g. 0/8), got {text!r}") from None
    if not 0 <= i < n:
        raise UserError(f"--part {text}: needs 0 <= i < n")
    return i, n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``cluster-fl features``."""
    add_config_arguments(parser)
    parser.add_argument("--part", default="0/1", help="i/n: this task's share of the work "
                        "(default 0/1: all of it)")


def run(args: argparse.Namespace) -> int:
    """``cluster-fl features``: compute what is missing, print what was done."""
    from cluster_fl.data.store import build_features

    part, parts = parse_part(args.part)
    missing = 0
    for data in data_configs(args.config, args.overrides):
        done = build_features(data, part, parts, log=lambda msg: print(
            f"features: {msg}", file=sys.stderr, flush=True))
        print(f"features: {done['items']} of {done['of']} work item(s) (part {part}/{parts}) "
              f"of splits {', '.join(done['splits'])}: {done['computed']} part(s) computed, "
              f"{done['unusable']} unusable row(s) skipped -> {done['store']}")
        missing += done["missing"] or 0
    if missing:
        print(f"features: {missing} part(s) still missing", file=sys.stderr)
        return 1
    return 0


def is_grid(path: str) -> bool:
    """Whether ``path`` is a grid file (it has ``axes`` or ``seeds``), not a config preset."""
    from pathlib import Path

    from cluster_fl.config import yaml_load

    try:
        tree = yaml_load(Path(path).expanduser().read_text())
    except OSError:
        return False
    return isinstance(tree, dict) and bool({"axes", "seeds"} & set(tree))


def data_configs(config: str, overrides: list[str]) -> list:
    """The distinct data sections (n_mels resolved) of a preset, or of a grid's cells."""
    if not is_grid(config):
        return [load_checked(config, overrides).data]  # n_mels: the model's
    from cluster_fl.config import parse_override
    from cluster_fl.sweep.gridspec import expand, load_grid

    specs = expand(load_grid(config), dict(parse_override(o) for o in overrides))
    return list(dict.fromkeys(spec.config.data for spec in specs))

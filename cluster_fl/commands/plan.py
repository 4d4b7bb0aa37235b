"""``cluster-fl plan CONFIG --gpus N --gpu-memory GiB``: per-GPU memory of a config, before a job
(:mod:`cluster_fl.sizing.plan`; the ``--json`` contract is documented there), and with
``--step-seconds`` the time of a round (:mod:`cluster_fl.sizing.round_time`). CONFIG may be a
grid file with ``--cell NAME``: that cell's config (its first seed)."""

from __future__ import annotations

import argparse
import json

from cluster_fl.commands import add_config_arguments, load_checked
from cluster_fl.errors import UserError
from cluster_fl.sizing.plan import PROFILES, format_plan, plan
from cluster_fl.sizing.round_time import format_round_time, round_time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``CONFIG [key=value ...] --gpus N --gpu-memory GiB [--seconds S] [--text-tokens T]``."""
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the job (N)")
    parser.add_argument("--gpu-memory", type=float, required=True, metavar="GiB",
                        help="memory of one GPU in GiB (e.g. 40, 80, 141)")
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="audio per utterance (default 15: a typical MLS utterance)")
    parser.add_argument("--text-tokens", type=int, default=64,
                        help="transcript tokens per utterance (default 64)")
    parser.add_argument("--device", default="cuda", choices=sorted(PROFILES),
                        help="overhead profile (default cuda)")
    parser.add_argument("--runs-per-gpu", type=int, default=1, metavar="N",
                        help="also check that N one-GPU runs of CONFIG fit on one GPU together "
                             "(resources.runs_per_gpu of a grid)")
    parser.add_argument("--step-seconds", type=float, default=None, metavar="S",
                        help="seconds of one local step (measured or stated): prints the "
                             "estimated time of a round")
    parser.add_argument("--utterances", type=int, default=None, metavar="U",
                        help="utterances of the largest client when data.max_utterances_per_"
                             "client is 0 (default 2000: MLS's largest speakers)")
    parser.add_argument("--cell", default=None, help="CONFIG is a grid file: plan this cell")
    parser.add_argument("--json", action="store_true", help="print the JSON contract")


def _config(args: argparse.Namespace):
    if args.cell is None:
        return load_checked(args.config, args.overrides)
    from cluster_fl.config import parse_override
    from cluster_fl.sweep.gridspec import expand, load_grid

    specs = expand(load_grid(args.config), dict(parse_override(o) for o in args.overrides))
    cells = list(dict.fromkeys(s.cell for s in specs))
    for spec in specs:
        if spec.cell == args.cell:
            return spec.config
    raise UserError(f"--cell {args.cell}: not a cell of {args.config} (cells: {', '.join(cells)})")


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 whether or not something fits (the message says which)."""
    cfg = _config(args)
    result = plan(cfg, args.gpus, args.gpu_memory, args.seconds, args.text_tokens, args.device,
                  runs_per_gpu=args.runs_per_gpu)
    timing = round_time(cfg, args.gpus, args.step_seconds, args.utterances)
    if args.json:
        print(json.dumps({**result, "round_time": timing}, indent=1))
    else:
        print(format_plan(result) + "\n" + format_round_time(timing))
    return 0

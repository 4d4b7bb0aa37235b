"""``cluster-fl plan CONFIG --gpus N --gpu-memory GiB``: per-GPU memory of a config, before a job
(:mod:`cluster_fl.sizing.plan`; the ``--json`` contract is documented there)."""

from __future__ import annotations

import argparse
import json

from cluster_fl.commands import add_config_arguments, load_checked
from cluster_fl.sizing.plan import PROFILES, format_plan, plan


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
    parser.add_argument("--json", action="store_true", help="print the JSON contract")


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 whether or not something fits (the message says which)."""
    cfg = load_checked(args.config, args.overrides)
    result = plan(cfg, args.gpus, args.gpu_memory, args.seconds, args.text_tokens, args.device,
                  runs_per_gpu=args.runs_per_gpu)
    print(json.dumps(result, indent=1) if args.json else format_plan(result))
    return 0

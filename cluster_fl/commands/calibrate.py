"""``cluster-fl calibrate CONFIG [--speakers N] [--write OUT.yaml] [--json]``: the norm probe on
public speakers and the recommended α (:mod:`cluster_fl.training.calibrate`)."""

from __future__ import annotations

import argparse
import json

from cluster_fl.commands import add_config_arguments, load_checked
from cluster_fl.training.calibrate import calibrate, format_result, write_preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``CONFIG [key=value ...] [--speakers N] [--write OUT.yaml] [--json]``."""
    add_config_arguments(parser)
    parser.add_argument("--speakers", type=int, default=8,
                        help="public speakers used as pseudo-clients (default 8)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="non-private FedAvg probe rounds whose norms are pooled (default 1)")
    parser.add_argument("--write", metavar="OUT.yaml", default=None,
                        help="write a preset with the recommendation and OUT.norms.json")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the probe, print the report, optionally write the preset."""
    cfg = load_checked(args.config, args.overrides)
    result = calibrate(cfg, args.speakers, args.rounds)
    if args.write:
        yaml_path, norms_path = write_preset(result, args.config, args.overrides, args.write)
        result["written"] = {"config": str(yaml_path), "norms": str(norms_path)}
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
    else:
        print(format_result(result))
        if args.write:
            print(f"wrote {result['written']['config']} and {result['written']['norms']}")
    return 0

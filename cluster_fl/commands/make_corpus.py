"""``cluster-fl make-corpus OUT [options]``: render the synthetic multilingual corpus (MLS layout).

The corpus itself -- speakers, eSpeak NG rendering, the Parquet layout -- is
:mod:`cluster_fl.data.corpus`; this command reads the options and prints the per-language /
split summary.
"""

from __future__ import annotations

import argparse

from cluster_fl.data.corpus import DEFAULT_SPEAKERS, format_manifest, make_corpus
from cluster_fl.data.vocab import LANGUAGES
from cluster_fl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``cluster-fl make-corpus``."""
    parser.add_argument("out", help="output folder (MLS Parquet layout)")
    parser.add_argument("--languages", default=",".join(LANGUAGES),
                        help="comma-separated language codes (default: all 8)")
    parser.add_argument("--speakers-per-language", type=int, default=None,
                        help="total speakers per language, spread 80:30:4 over "
                             "public/private/test")
    parser.add_argument("--utterances-per-speaker", type=int, default=None,
                        help="utterances of every speaker (overrides the per-split sizes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--public-speakers", type=int, default=None,
                        help=f"per language (default {DEFAULT_SPEAKERS['public']})")
    parser.add_argument("--private-speakers", type=int, default=None)
    parser.add_argument("--test-speakers", type=int, default=None)
    parser.add_argument("--public-utterances", type=int, default=50)
    parser.add_argument("--private-utterances", default="20-60", help="LO-HI per speaker")
    parser.add_argument("--test-utterances", type=int, default=25)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    """``cluster-fl make-corpus``: render, then print the per-language/split summary."""
    try:
        lo, _, hi = args.private_utterances.partition("-")
        private = (int(lo), int(hi or lo))
    except ValueError:
        raise UserError(f"--private-utterances: expected LO-HI, got {args.private_utterances!r}")
    manifest = make_corpus(
        args.out, [s.strip() for s in args.languages.split(",") if s.strip()],
        args.speakers_per_language, args.utterances_per_speaker, args.seed,
        public_speakers=args.public_speakers, private_speakers=args.private_speakers,
        test_speakers=args.test_speakers, public_utterances=args.public_utterances,
        private_utterances=private, test_utterances=args.test_utterances,
        workers=args.workers, progress=not args.quiet)
    print(format_manifest(manifest))
    return 0



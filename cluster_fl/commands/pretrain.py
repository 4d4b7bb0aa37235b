"""``cluster-fl pretrain CONFIG [key=value ...] [--force]``: central pretraining of a tiny
speech-LLM on the public speakers (:mod:`cluster_fl.training.pretrain`), the stand-in for
pretrained Whisper / TinyLlama weights. The budget is ``pretrain.steps`` (the same checkpoint on
any machine speed); ``pretrain.minutes`` caps one call, which then exits 2 with the unfinished
checkpoint saved, and the next call resumes it."""

from __future__ import annotations

import argparse

from cluster_fl.commands import add_config_arguments, load_checked


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``CONFIG [key=value ...] [--force]``."""
    add_config_arguments(parser)
    parser.add_argument("--force", action="store_true",
                        help="retrain even if a finished checkpoint exists")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``cluster-fl pretrain``."""
    import torch

    from cluster_fl.distributed.launch import cpu_mask
    from cluster_fl.training.pretrain import pretrain

    cfg = load_checked(args.config, args.overrides)
    torch.set_num_threads(cfg.run.threads or len(cpu_mask()))  # the CPUs this process may use
    result = pretrain(cfg, force=args.force)
    print(f"checkpoint: {result['out']}  (step {result['step']}, held-out WER {result['wer']:.3f})")
    return 0

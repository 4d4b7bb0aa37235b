"""Benchmark: seconds per pretraining step of the tiny speech-LLM, variants side by side.

Times full training steps (forward, backward, AdamW) on the same batches of the default corpus,
interleaving the variants (A B A B ...) so that a noisy shared machine slows them alike, and
prints each variant's median step time and its ratio to the first.

    python bench/pretrain_step.py --corpus /tmp/corpus --steps 30 --threads 2

Variants: the registry's tiny model as built (``built``) and the same model with PyTorch's
scaled-dot-product attention (``sdpa``), the transformers default the registry overrides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=None,
                        help="corpus folder (default: the demo's, $CLUSTER_FL_CACHE/corpus-v3)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=24)
    args = parser.parse_args()

    import numpy as np
    import torch

    from cluster_fl.config import load_config
    from cluster_fl.models.registry import resolve_shapes  # a benchmark is a run's entrance
    from cluster_fl.data import make_corpus
    from cluster_fl.data.corpus import default_corpus
    from cluster_fl.models.build import build_base
    from cluster_fl.models.speech_llm import collate
    from cluster_fl.training.pretrain import _load_public, batch_order

    corpus = Path(args.corpus).expanduser() if args.corpus else default_corpus()
    if not (corpus / "manifest.json").is_file():
        make_corpus(corpus, progress=False)
    torch.set_num_threads(args.threads)
    cfg = resolve_shapes(load_config(REPO / "configs" / "pretrain.yaml", [f"data.corpus={corpus}"]))
    examples = _load_public(cfg)
    order = batch_order([e.features.shape[-1] for e in examples], args.batch_size,
                        np.random.default_rng(0))
    batches = [collate([examples[i].features for i in idx], [examples[i].transcript for i in idx],
                       [examples[i].language for i in idx])
               for idx in order[: args.warmup + args.steps]]

    def variant(attn: str | None):
        torch.manual_seed(0)
        model = build_base(cfg.model)
        if attn is not None:
            for module in model.modules():
                if getattr(module, "config", None) is not None:
                    module.config._attn_implementation = attn
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(batch) -> float:
            began = time.perf_counter()
            loss, _ = model.loss(batch, ctc_weight=cfg.pretrain.ctc_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return time.perf_counter() - began
        return step

    variants = {"built": variant(None), "sdpa": variant("sdpa")}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i, batch in enumerate(batches):
        for name, step in variants.items():
            took = step(batch)
            if i >= args.warmup:
                times[name].append(took)
    base = statistics.median(times["built"])
    record = {"threads": args.threads, "batch_size": args.batch_size, "steps": args.steps,
              "s_per_step": {k: round(statistics.median(v), 4) for k, v in times.items()},
              "ratio_to_built": {k: round(statistics.median(v) / base, 3)
                                 for k, v in times.items()}}
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

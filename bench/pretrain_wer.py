"""Benchmark: held-out WER of the tiny speech-LLM after central pretraining on a CPU budget.

Goal: WER <= 0.25 on held-out public speakers within 15 minutes on 2 CPU cores.
Builds the default synthetic corpus if missing, pretrains with ``configs/pretrain.yaml`` plus
overrides, and writes a JSON record with the WER history (step, minutes, WER), the thread count
and the machine load seen during the run, so a result can be read against its conditions.
After training it also scores the checkpoint on 200 utterances of its *training* speakers and on
the corpus's test speakers (voice variants never seen in pretraining): the train/held-out gap
says whether a recipe is short of fitting or of generalising (results/LOG.md, 2026-12-03). The
held-out set is 8 speakers per language (64); with 2 per language one hard voice moved the
figure by ~0.05.

    python bench/pretrain_wer.py --corpus /tmp/corpus --minutes 15 --threads 2 --out /tmp/pre
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def extra_scores(cfg, checkpoint: str, store, public: list) -> dict[str, float]:
    """WER of the checkpoint on up to 200 training-speaker utterances and on the test speakers."""
    import numpy as np

    from cluster_fl.eval.evaluate import evaluate
    from cluster_fl.models.checkpoint import load_checkpoint
    from cluster_fl.training.pretrain import split_heldout

    train_set, _ = split_heldout(public, cfg.pretrain.heldout_speakers, cfg.run.seed)
    pick = np.random.default_rng(cfg.run.seed + 1).choice(
        len(train_set), min(200, len(train_set)), replace=False)
    sets = {"train_speakers_wer": [train_set[i] for i in sorted(pick)],
            "test_speakers_wer": store.split("test", languages=list(cfg.data.languages))}
    model = load_checkpoint(checkpoint).eval()
    return {key: round(evaluate(model, examples, batch_size=cfg.eval.batch_size,
                                max_new_tokens=cfg.eval.max_new_tokens, bootstrap=0,
                                decode_cache=cfg.eval.decode_cache)[0]["wer"], 4)
            for key, examples in sets.items() if examples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=None,
                        help="corpus folder (default: the demo's, $CLUSTER_FL_CACHE/corpus-v3)")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=1000, help="steps between WER checks")
    parser.add_argument("--out", default="/tmp/cluster_fl_bench/pretrain")
    parser.add_argument("--json", default=None, help="write the record here (default: stdout)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    import torch

    from cluster_fl.config import load_config
    from cluster_fl.data import FeatureStore, make_corpus
    from cluster_fl.data.corpus import default_corpus
    from cluster_fl.training.pretrain import pretrain

    corpus = Path(args.corpus).expanduser() if args.corpus else default_corpus()
    began = time.monotonic()
    if not (corpus / "manifest.json").is_file():
        make_corpus(corpus, progress=False)
    corpus_s = time.monotonic() - began
    torch.set_num_threads(args.threads)
    cfg = load_config(REPO / "configs" / "pretrain.yaml", [
        f"data.corpus={corpus}", f"pretrain.minutes={args.minutes}",
        f"pretrain.eval_every={args.eval_every}", f"pretrain.out={args.out}",
        f"run.threads={args.threads}", *args.overrides])
    from cluster_fl.models.registry import resolve_shapes

    cfg = resolve_shapes(cfg)  # data.n_mels: the model's
    store = FeatureStore.from_config(cfg.data)  # read once: pretraining and the extra scores
    public = store.split("public", languages=list(cfg.data.languages))
    loads: list[float] = []

    def log(line: str) -> None:
        loads.append(os.getloadavg()[0])
        print(line, flush=True)

    result = pretrain(cfg, examples=public, force=True, log=log)
    extra = extra_scores(cfg, result["out"], store, public)
    record = {
        "goal": "held-out WER <= 0.25 within 15 min on 2 CPU cores",
        "minutes_budget": args.minutes, "threads": args.threads, "cpu_count": os.cpu_count(),
        "load_avg_1min_mean": round(sum(loads) / max(len(loads), 1), 2),
        "load_avg_1min_max": round(max(loads, default=0.0), 2),
        "corpus_build_s": round(corpus_s, 1), "steps": result["step"],
        "train_s": round(result["elapsed_s"], 1), "final_wer": result["wer"],
        "history": result["history"], "checkpoint": result["out"], **extra,
        "met_goal": bool(result["wer"] <= 0.25 and result["elapsed_s"] <= 15 * 60 + 1),
    }
    text = json.dumps(record, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``cluster-fl demo``: the embedded default, end to end, on CPU (DESIGN §11).

1. builds the synthetic 8-language corpus (eSpeak NG) in the cache, once;
2. pretrains the tiny speech-LLM on the public speakers, once (cached);
3. runs a few federated rounds per method -- non-private FedAvg, flat, size, α-split -- on the
   private speakers, through the same ``run_training`` path a cluster run takes;
4. prints a table of WER, ε and per-pool effective σ, with the starting model (``round-0``: the
   pretrained model before any federated round, scored on the same evaluation set by the same
   evaluation) beside the methods, so the table shows what federated training changed.

The round-0 score is kept under ``<out>/demo/`` (``cluster_fl.experiments.round0``), so
``cluster-fl table`` shows it too.

Everything is cached under ``--cache`` (default ``$CLUSTER_FL_CACHE`` or ``~/.cache/cluster_fl``),
so a second run skips steps 1-2 and finished runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cluster_fl.config import load_config, replace
from cluster_fl.data.corpus import DEFAULT_FOLDER, default_cache
from cluster_fl.engine.rundir import is_done, run_dir
from cluster_fl.experiments.round0 import evaluate_round0
from cluster_fl.errors import UserError

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "demo.yaml"
METHODS = {
    "fedavg": {"privacy.mechanism": "none"},
    "flat": {"privacy.clipping": "flat"},
    "size": {"privacy.clipping": "size"},
    "alpha-split": {"privacy.clipping": "alpha-split"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides of the demo config (e.g. fl.rounds=2)")
    parser.add_argument("--cache", type=Path, default=None, help="corpus + checkpoint cache")
    parser.add_argument("--out", type=Path, default=None, help="results root (default: cache/results)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--languages", default=None, help="comma-separated subset of languages")
    parser.add_argument("--speakers-per-language", type=int, default=None,
                        help="private speakers per language (smaller corpus, for quick checks)")
    parser.add_argument("--pretrain-minutes", type=float, default=None,
                        help="pretraining budget (default: the demo config's)")
    parser.add_argument("--pretrain-steps", type=int, default=None,
                        help="pretraining steps instead of a time budget")


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from cluster_fl.data import count_clients, make_corpus
    from cluster_fl.engine.train import PREEMPTED_EXIT, Preempted, run_training
    from cluster_fl.experiments.results import find_runs
    from cluster_fl.experiments.table import summarise, to_markdown
    from cluster_fl.training.pretrain import pretrain

    t0 = time.perf_counter()
    cache = (args.cache or default_cache()).expanduser()
    out = (args.out or cache / "results").expanduser()
    cfg = load_config(DEMO_CONFIG, args.overrides)
    changes: dict = {"run.out": str(out)}
    langs = args.languages.split(",") if args.languages else list(cfg.data.languages)
    changes["data.languages"] = langs
    reduced = args.languages is not None or args.speakers_per_language is not None
    corpus = cache / (f"{DEFAULT_FOLDER}-{'-'.join(langs)}-{args.speakers_per_language}"
                      if reduced else DEFAULT_FOLDER)
    changes["data.corpus"] = str(corpus)
    ckpt = cache / "pretrain" / corpus.name / cfg.model.arch
    changes["pretrain.out"] = str(ckpt)
    if args.pretrain_minutes is not None:
        changes["pretrain.minutes"] = args.pretrain_minutes
    if args.pretrain_steps is not None:
        changes["pretrain.steps"] = args.pretrain_steps
        if args.pretrain_minutes is None:
            changes["pretrain.minutes"] = 0.0
    cfg = replace(cfg, changes)

    _say(f"1/4 synthetic corpus ({len(langs)} languages) -> {corpus}")
    kwargs = {}
    if args.speakers_per_language is not None:
        public = max(4, args.speakers_per_language)
        kwargs = {"private_speakers": args.speakers_per_language, "public_speakers": public,
                  "test_speakers": 2}
        # a reduced corpus cannot spare the default held-out speakers: keep 3 of 4 for training
        held = min(cfg.pretrain.heldout_speakers, max(1, public // 4))
        cfg = replace(cfg, {"pretrain.heldout_speakers": held})
    manifest = make_corpus(corpus, languages=langs, seed=cfg.run.seed, **kwargs)
    _say(f"   corpus ready: {_manifest_line(manifest)}")

    _say(f"2/4 tiny speech-LLM pretrained on the public speakers -> {ckpt}")
    result = pretrain(cfg, log=lambda m: _say("   " + m))  # returns at once when cached
    _say(f"   pretrained: {result.get('step')} steps, held-out public WER {result.get('wer')}"
         + (" (cached)" if result.get("cached") else ""))
    cfg = replace(cfg, {"model.checkpoint": str(ckpt)})
    population = count_clients(cfg.data)
    if cfg.fl.clients_per_round > population:  # a reduced corpus: cohort = everyone
        _say(f"   fl.clients_per_round {cfg.fl.clients_per_round} > {population} clients; using {population}")
        cfg = replace(cfg, {"fl.clients_per_round": population})

    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(sorted(unknown))}; "
                        f"allowed: {', '.join(METHODS)}")
    folders = []
    for i, m in enumerate(methods, 1):
        run_cfg = replace(cfg, {**METHODS[m], "run.experiment": "demo"})
        state = "cached" if is_done(run_dir(run_cfg)) else "running"
        _say(f"3/4 [{i}/{len(methods)}] {m}: {run_cfg.fl.rounds} rounds ({state})")
        try:
            folders.append(run_training(run_cfg))
        except Preempted as exc:
            _say(f"   stopped by signal ({exc.folder}); run the demo again to resume")
            return PREEMPTED_EXIT
    start = evaluate_round0(replace(cfg, {"run.experiment": "demo"}), say=_say)
    _say("4/4 results")
    print(to_markdown(summarise(find_runs([start, *folders]))))
    _say(f"done in {time.perf_counter() - t0:.0f}s; run folders under {out / 'demo'}")
    return 0


def _manifest_line(manifest: dict) -> str:
    total = manifest.get("total", {})
    return (f"{total.get('utterances', '?')} utterances, {total.get('hours', '?')} h "
            f"in {len(manifest.get('counts', {})) or '?'} language(s)")

"""``cluster-fl demo``: the embedded default, end to end, on CPU (DESIGN §11).

1. builds the synthetic 8-language corpus (eSpeak NG) in the cache, once;
2. takes the study's starting model: the tiny speech-LLM pretrained on the public speakers for
   5,600 steps (``configs/pretrain-repro.yaml``), whose bytes a checkout commits under
   ``results/repro/starting-model/`` -- copied into the cache and checked against its SHA-256, so
   every machine starts from the same model (a step budget fixes a model for a machine's speed,
   not for its CPU's kernels: PROTOCOL §6). Where there is none (an installed wheel, a reduced
   corpus, another architecture) or ``--pretrain-steps`` asks for it, the demo pretrains its own
   for a budget of steps instead, once (cached per step budget);
3. runs the study's heavy regime (``assets/demo-heavy.yaml``: a fresh connector that federated
   training has to learn, encoder LR x 0.1, the paper's σ and per-layer thresholds) for each
   method -- flat, α-split, uniform by default -- on the private speakers, through the same
   ``run_training`` path a cluster run takes; every 3 rounds a run logs its test WER
   (``eval.every``), the line to follow while the noised per-round diagnostics of ~24 clients
   are too noisy to show;
4. prints a table of WER (speaker-clustered CIs), ε and per-pool effective σ, with the starting
   model (``round-0``: the pretrained model with its new connector, scored on the same evaluation
   set by the same evaluation) beside the methods, then every method paired against flat
   (``cluster-fl table --against flat``): which ones learn and which fall behind.

The round-0 score is kept under ``<out>/demo/`` (``cluster_fl.report.round0``), so
``cluster-fl table`` shows it too.

Everything is cached under ``--cache`` (default ``$CLUSTER_FL_CACHE`` or ``~/.cache/cluster_fl``),
so a second run skips steps 1-2 and finished runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cluster_fl.commands import load_checked
from cluster_fl.config import override
from cluster_fl.data.corpus import DEFAULT_FOLDER, default_cache
from cluster_fl.engine.rundir import is_done, run_dir
from cluster_fl.report.round0 import evaluate_round0
from cluster_fl.errors import UserError

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "demo-heavy.yaml"
METHODS = {
    "fedavg": {"privacy.mechanism": "none"},
    "flat": {"privacy.clipping": "flat"},
    "alpha-split": {"privacy.clipping": "alpha-split"},
    "uniform": {"privacy.clipping": "uniform"},
    "size": {"privacy.clipping": "size"},
    "size-ema": {"privacy.clipping": "size-ema"},
}
DEFAULT_METHODS = ("flat", "alpha-split", "uniform")  # ~2 min each on 2 cores (AMD, 2026-12-06)
PRETRAIN_THREADS = 2  # the demo's pretraining threads on any machine (its starting model's bytes)
# a checkout's committed starting models (launch/repro_prepare.sh places them for the study)
COMMITTED = Path(__file__).resolve().parents[2] / "results" / "repro" / "starting-model"
STARTING_MODEL = "repro-joint-5600steps"  # the study's (PROTOCOL §6): 5,600 steps, corpus-v3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides of the demo config (e.g. fl.rounds=2)")
    parser.add_argument("--cache", type=Path, default=None, help="corpus + checkpoint cache")
    parser.add_argument("--out", type=Path, default=None, help="results root (default: cache/results)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--languages", default=None, help="comma-separated subset of languages")
    parser.add_argument("--speakers-per-language", type=int, default=None,
                        help="private speakers per language (smaller corpus, for quick checks)")
    parser.add_argument("--pretrain-steps", type=int, default=None,
                        help="pretrain the demo's own starting model for this many steps instead "
                             "of taking the committed one (without one: the demo config's budget)")
    parser.add_argument("--pretrain-minutes", type=float, default=None,
                        help="a wall-clock cap on pretraining: when it cuts the step budget short "
                             "the demo stops with a message and the next call resumes")
    parser.add_argument("--ranks", type=int, default=None,
                        help="processes per federated run (default: the CPU count, at most 4); "
                             "a run is bitwise identical on any number of ranks")


def pretrain_threads(cfg) -> int:  # noqa: ANN001 - a Config
    """The demo's pretraining threads: ``run.threads``, else a fixed count, not the machine's
    cores -- a float sum split over another number of threads rounds differently, and 120 steps
    at 1 and 2 threads already give different checkpoints (results/LOG.md, 2026-12-05)."""
    return cfg.run.threads or PRETRAIN_THREADS


def committed_starting_model(cache: Path, corpus: Path, arch: str,
                             committed: Path = COMMITTED) -> Path | None:
    """The study's committed starting model, placed in ``cache`` where ``launch/repro_prepare.sh``
    puts it and checked against ``SHA256SUMS``; None where there is none for ``arch`` (an installed
    wheel has no ``results/``). A copy whose bytes differ is refused, never used."""
    from cluster_fl.engine.provenance import model_sha256
    from cluster_fl.models.checkpoint import read_meta

    source, sums = committed / STARTING_MODEL, committed / "SHA256SUMS"
    if not (sums.is_file() and (source / "model.pt").is_file()
            and read_meta(source).get("arch") == arch):
        return None
    want = next((line.split()[0] for line in sums.read_text().splitlines()
                 if line.split()[1:] == [f"{STARTING_MODEL}/model.pt"]), None)
    dest = cache / "pretrain" / corpus.name / STARTING_MODEL
    if not (dest / "model.pt").is_file():  # copied whole or not at all
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source, partial)
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)
    got = model_sha256(str(dest))
    if want is None or got != want:
        raise UserError(f"the starting model in {dest} has SHA-256 {got}, {sums} wants {want}; "
                        f"delete {dest} to copy it again from {source}")
    return dest


def default_ranks() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def train_on_ranks(cfg, ranks: int) -> Path:
    """One federated run of ``cfg`` as ``ranks`` local processes (torchrun), its progress on
    stderr; returns the run folder. ``ranks == 1`` trains in this process."""
    from cluster_fl.config import dump_config
    from cluster_fl.distributed.launch import local_ranks_command
    from cluster_fl.errors import PREEMPTED_EXIT
    from cluster_fl.engine.train import Preempted, run_training

    if ranks == 1:
        return run_training(cfg)
    folder = run_dir(cfg)
    folder.parent.mkdir(parents=True, exist_ok=True)
    resolved = folder.parent / f".{folder.name}.yaml"  # what the ranks load: the run's config
    resolved.write_text(dump_config(override(cfg, {"run.threads": 1})))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(local_ranks_command(ranks, ["train", str(resolved)]), env=env,
                          stdout=sys.stderr)
    if is_done(folder):
        return folder
    if proc.returncode == PREEMPTED_EXIT or proc.returncode < 0:
        raise Preempted(folder)
    raise UserError(f"the run in {folder} failed on {ranks} ranks (exit {proc.returncode}); "
                    f"its log: {folder / 'log.txt'}; `--ranks 1` runs it in this process")


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from cluster_fl.data import count_clients, make_corpus
    from cluster_fl.errors import PREEMPTED_EXIT
    from cluster_fl.engine.train import Preempted
    from cluster_fl.report.compare import compare, comparisons_markdown
    from cluster_fl.report.results import find_runs
    from cluster_fl.report.table import summarise, to_markdown
    from cluster_fl.models.checkpoint import read_meta
    from cluster_fl.training.pretrain import pretrain

    import torch

    t0 = time.perf_counter()
    # arguments are checked before anything is rendered or trained
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if not methods:
        raise UserError(f"--methods: give at least one of {', '.join(METHODS)}")
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(sorted(unknown))}; "
                        f"allowed: {', '.join(METHODS)}")
    ranks = default_ranks() if args.ranks is None else args.ranks
    if ranks < 1:
        raise UserError(f"--ranks: must be >= 1, got {ranks}")
    cache = (args.cache or default_cache()).expanduser()
    out = (args.out or cache / "results").expanduser()
    cfg = load_checked(DEMO_CONFIG, args.overrides)  # the run's entrance: resolved once
    changes: dict = {"run.out": str(out)}
    langs = args.languages.split(",") if args.languages else list(cfg.data.languages)
    changes["data.languages"] = langs
    reduced = args.languages is not None or args.speakers_per_language is not None
    corpus = cache / (f"{DEFAULT_FOLDER}-{'-'.join(langs)}-{args.speakers_per_language}"
                      if reduced else DEFAULT_FOLDER)
    changes["data.corpus"] = str(corpus)
    if args.pretrain_minutes is not None:
        changes["pretrain.minutes"] = args.pretrain_minutes
    if args.pretrain_steps is not None:
        changes["pretrain.steps"] = args.pretrain_steps
    cfg = override(cfg, changes)
    # one cached checkpoint per step budget: another budget is another starting model
    budget = (f"{cfg.pretrain.steps}steps" if cfg.pretrain.steps
              else f"{cfg.pretrain.minutes:g}min")
    ckpt = cache / "pretrain" / corpus.name / f"{cfg.model.arch}-{budget}"
    cfg = override(cfg, {"pretrain.out": str(ckpt)})

    _say(f"1/4 synthetic corpus ({len(langs)} languages) -> {corpus}")
    kwargs = {}
    if args.speakers_per_language is not None:
        public = max(4, args.speakers_per_language)
        kwargs = {"private_speakers": args.speakers_per_language, "public_speakers": public,
                  "test_speakers": 2}
        # a reduced corpus cannot spare the default held-out speakers: keep 3 of 4 for training
        held = min(cfg.pretrain.heldout_speakers, max(1, public // 4))
        cfg = override(cfg, {"pretrain.heldout_speakers": held})
    manifest = make_corpus(corpus, languages=langs, seed=cfg.run.seed, **kwargs)
    _say(f"   corpus ready: {_manifest_line(manifest)}")

    own = reduced or args.pretrain_steps is not None or args.pretrain_minutes is not None
    committed = None if own else committed_starting_model(cache, corpus, cfg.model.arch)
    if committed is not None:
        ckpt = committed
        meta = read_meta(ckpt)
        _say(f"2/4 the study's starting model ({meta.get('step')} pretraining steps, held-out "
             f"public WER {meta.get('wer', float('nan')):.3f}; SHA-256 checked) -> {ckpt}")
    else:
        _say(f"2/4 tiny speech-LLM pretrained on the public speakers -> {ckpt}")
        torch.set_num_threads(pretrain_threads(cfg))
        result = pretrain(cfg, log=lambda m: _say("   " + m))  # returns at once when cached
        _say(f"   pretrained: {result.get('step')} steps, held-out public WER {result.get('wer')}"
             + (" (cached)" if result.get("cached") else ""))
    cfg = override(cfg, {"model.checkpoint": str(ckpt)})
    population = count_clients(cfg.data)
    if cfg.fl.clients_per_round > population:  # a reduced corpus: cohort = everyone
        _say(f"   fl.clients_per_round {cfg.fl.clients_per_round} > {population} clients; using {population}")
        cfg = override(cfg, {"fl.clients_per_round": population})

    folders = []
    for i, m in enumerate(methods, 1):
        run_cfg = override(cfg, {**METHODS[m], "run.experiment": "demo"})
        state = "cached" if is_done(run_dir(run_cfg)) else "running"
        _say(f"3/4 [{i}/{len(methods)}] {m}: {run_cfg.fl.rounds} rounds ({state}"
             + (f", {ranks} ranks)" if state == "running" and ranks > 1 else ")"))
        try:
            folders.append(train_on_ranks(run_cfg, ranks))
        except Preempted as exc:
            _say(f"   stopped by signal ({exc.folder}); run the demo again to resume")
            return PREEMPTED_EXIT
    start = evaluate_round0(override(cfg, {"run.experiment": "demo"}), say=_say)
    _say("4/4 results")
    runs = find_runs([start, *folders])
    print(to_markdown(summarise(runs)))
    if "flat" in methods:
        print(comparisons_markdown(compare(runs, "flat")))
    _say(f"done in {time.perf_counter() - t0:.0f}s; run folders under {out / 'demo'}")
    return 0


def _manifest_line(manifest: dict) -> str:
    total = manifest.get("total", {})
    return (f"{total.get('utterances', '?')} utterances, {total.get('hours', '?')} h "
            f"in {len(manifest.get('counts', {})) or '?'} language(s)"
            + (f", digest {manifest['digest'][:16]}" if "digest" in manifest else ""))

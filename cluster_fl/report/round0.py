"""The starting model's score (``round-0``): the model a run starts from, before any federated
round, on the run's own evaluation set by the run's own evaluation -- the baseline a table
measures federated training against (the demo's, and a study's via ``grid --round0``).

It is kept as ``<out>/<experiment>/<arch>_<condition>_round-0_s<seed>_<hash>/`` holding
``final.parquet`` (method ``round-0``, 0 rounds, ε 0: nothing of the private clients was used,
with the config, so the row lands in its run's table cell) and ``eval.parquet``; the hash covers
what the score depends on (model, data, evaluation, seed) and the regime (client), so it is computed once.
There is one starting model per seed: a fresh connector (``model.connector_init: fresh``) is drawn
from the run's seed (``model.connector_seed``), so a study's round-0 varies over its seeds as its
runs do, and every method of one seed starts from the same model (before, every seed
shared connector seed 0 and round-0 was one model scored once per seed).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from cluster_fl.config import Config, to_dict

if TYPE_CHECKING:
    from cluster_fl.sweep.gridspec import Grid


def round0_folder(cfg: Config) -> Path:
    """Where the starting score of runs of ``cfg`` is kept."""
    from cluster_fl.engine.rundir import path_names

    tree = path_names(to_dict(cfg))  # corpus and checkpoint by folder name, as run ids
    # `client` does not change the starting model but names the regime (its table cell): two
    # regimes keep two folders
    key = json.dumps({k: tree[k] for k in ("model", "data", "eval", "client")}
                     | {"seed": cfg.run.seed}, sort_keys=True)
    condition = "frozen" if cfg.model.freeze_encoder else "unfrozen"
    return (Path(cfg.run.out).expanduser() / cfg.run.experiment /
            f"{cfg.model.arch}_{condition}_round-0_s{cfg.run.seed}_"
            f"{hashlib.sha1(key.encode()).hexdigest()[:8]}")


def evaluate_round0(cfg: Config, say: Callable[[str], None] = print) -> Path:
    """Score the starting model of ``cfg`` once (cached) and return its folder."""
    from cluster_fl.engine.metrics import read_rows, write_rows
    from cluster_fl.engine.provenance import FILE as PROVENANCE
    from cluster_fl.engine.provenance import model_sha256, record_attempt
    from cluster_fl.engine.train import evaluate_start

    folder = round0_folder(cfg)
    final_path = folder / "final.parquet"
    # a folder from before the row carried its config is redone, so it joins its cell
    cached = final_path.is_file() and bool(read_rows(final_path)[0].get("config_json"))
    provenance = folder / PROVENANCE
    if cached and provenance.is_file() and model_sha256(cfg.model.checkpoint) != json.loads(
            provenance.read_text())["starting_model"]["model_sha256"]:
        cached = False  # scored on other bytes under the same checkpoint folder: score again
        provenance.unlink()
    if not cached:
        summary, rows = evaluate_start(cfg)
        folder.mkdir(parents=True, exist_ok=True)
        write_rows(folder / "eval.parquet", rows)
        write_rows(final_path, [{
            "run_id": folder.name, "experiment": cfg.run.experiment, "arch": cfg.model.arch,
            "freeze_encoder": cfg.model.freeze_encoder, "method": "round-0", "seed": cfg.run.seed,
            "rounds": 0, "epsilon": 0.0, "delta": cfg.privacy.delta, **summary,
            "config_json": json.dumps(to_dict(cfg), sort_keys=True, default=str)}])
        record_attempt(folder, cfg)
    final = read_rows(final_path)[0]
    say(f"   round 0 (the starting model, before federated training): WER "
        f"{final.get('wer', float('nan')):.4f} on the same evaluation set"
        + (" (cached)" if cached else ""))
    return folder


def score_round0(grid: "Grid", extra: Mapping[str, Any] | None = None,
                 say: Callable[[str], None] = print) -> list[Path]:
    """``grid --round0``: the starting score of every arch x condition x seed of ``grid`` (one
    per cell family: the method does not change the starting model), in this process."""
    from cluster_fl.sweep.gridspec import expand

    seen: dict[tuple, Path] = {}
    for spec in expand(grid, extra):
        key = tuple(sorted((k, v) for k, v in spec.axes.items() if k != "method")) + (spec.seed,)
        if key not in seen:
            say(f"round 0 of {' '.join(f'{k}={v}' for k, v in key[:-1])} seed={spec.seed}")
            seen[key] = evaluate_round0(spec.config, say=say)
    return list(seen.values())

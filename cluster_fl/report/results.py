"""Reading finished run folders (the engine's documented format) for ``table`` and ``plot``.

A run folder is found by its ``final.parquet``; every other file is read on demand, so tables of a
large grid do not load per-utterance rows they do not need. Labels shared by tables and figures
(condition names, method labels and their order) live here so both say the same thing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from cluster_fl.config import PrivacyConfig
from cluster_fl.errors import UserError, short_reason

# Column order of the paper's tables: the starting model (the demo's round 0), the non-private
# ceiling, flat, the six single-pool methods, then the component-aware ones.
METHOD_ORDER = ("round-0", "fedavg", "flat", "uniform", "size", "uniform-ema", "size-ema", "quantile",
                "probe", "alpha-split", "pools")
# round-0's guarantee: the starting model is scored before any round, so no client's data was used
NO_CLIENT_DATA = "no client data"


@dataclass
class Run:
    """One finished run: its folder and its ``final.parquet`` row."""

    folder: Path
    final: dict[str, Any] = field(repr=False)

    @property
    def arch(self) -> str:
        return str(self.final.get("arch", "?"))

    @property
    def condition(self) -> str:
        """``frozen`` or ``unfrozen`` (the paper's ``-e`` suffix) encoder; a trained encoder with a
        client LR multiplier other than 1 says so (``unfrozen enc-lr×0.1``: the study's heavy
        regime), so runs of two regimes never share a table cell."""
        if bool(self.final.get("freeze_encoder")):
            return "frozen"
        mult = self.config.get("client", {}).get("lr_encoder_mult", 1.0)
        return "unfrozen" if mult in (None, 1.0) else f"unfrozen enc-lr×{float(mult):g}"

    @property
    def method(self) -> str:
        """Method label: ``fedavg`` for no privacy, ``alpha-split α=0.05`` for split methods,
        ``pools 0.1/0.3/0.6`` (the shares) for K pools, ``inside uniform`` when a split's rule
        inside the pools is not the default (size); a method with per-group thresholds says
        ``per-layer`` when its groups are layers (``privacy.grouping: layer``, the paper's). Runs
        of two configurations never share a cell."""
        method = str(self.final.get("method", "?"))
        if method == "none":
            return "fedavg"
        pools = self.setting("privacy", "pools", None)
        if method == "alpha-split":
            method = f"alpha-split α={float(self.final.get('alpha', float('nan'))):g}"
        elif method == "pools" and pools:
            method += " " + "/".join(f"{float(p['share']):g}" for p in pools)
        inside = self.setting("privacy", "inside_pool", PrivacyConfig.inside_pool)
        if method.startswith(("alpha-split", "pools")) and inside != PrivacyConfig.inside_pool:
            method += f" inside {inside}"
        if method not in ("flat", "round-0") and self.grouping == "layer":
            method += " per-layer"
        return method

    @property
    def grouping(self) -> str:
        """``privacy.grouping`` of the run (the config's default when its config does not say)."""
        return str(self.setting("privacy", "grouping", PrivacyConfig.grouping))

    @property
    def seed(self) -> int:
        """The run's seed; -1 for a secure-mode run (no seed: drawn from the OS, never kept)."""
        seed = self.final.get("seed", 0)
        return -1 if seed is None else int(seed)

    @property
    def guarantee(self) -> str:
        """The run's guarantee (``privacy.accounting.GUARANTEES``): valid, simulation, void or
        none; ``NO_CLIENT_DATA`` for round-0. Records written before research runs were told
        apart said ``valid`` for every run with a guarantee; a research-mode one among them is a
        ``simulation``."""
        if self.method == "round-0":  # the starting model touched no client's data: ε is 0
            return NO_CLIENT_DATA
        fallback = "none" if self.method == "fedavg" else "?"  # FedAvg: no mechanism, ε = ∞
        g = str(self.final.get("guarantee") or fallback)
        if g == "valid" and not self.setting("privacy", "secure_mode", False):
            return "simulation"
        return g

    @property
    def wer(self) -> float:
        return float(self.final.get("wer", float("nan")))

    @property
    def sigmas(self) -> dict[str, float]:
        """Effective noise multiplier per pool (``sigma/<pool>`` columns)."""
        return {k.split("/", 1)[1]: float(v) for k, v in self.final.items()
                if k.startswith("sigma/") and v is not None}

    @cached_property
    def eval_rows(self) -> list[dict[str, Any]] | None:
        """Per-utterance evaluation rows, or None when the run has no ``eval.parquet``."""
        path = self.folder / "eval.parquet"
        if not path.is_file():
            return None
        return pq.read_table(path, columns=["speaker", "word_errors", "ref_words"]).to_pylist()

    @cached_property
    def rounds(self) -> list[dict[str, Any]]:
        """Per-round metrics rows (empty when the run has no ``rounds.parquet``)."""
        path = self.folder / "rounds.parquet"
        return pq.read_table(path).to_pylist() if path.is_file() else []

    def round_values(self, column: str) -> list[float]:
        """The finite values of a ``rounds.parquet`` column, round by round."""
        return [float(row[column]) for row in self.rounds
                if row.get(column) is not None and math.isfinite(row[column])]

    def round_mean(self, column: str) -> float:
        """Mean of a ``rounds.parquet`` column over the rounds that have a finite value (NaN
        when none has)."""
        values = self.round_values(column)
        return float(sum(values) / len(values)) if values else math.nan

    @cached_property
    def groups(self) -> list[dict[str, Any]]:
        """``groups.json``: [{name, component, numel, pool, threshold}] (empty when absent)."""
        path = self.folder / "groups.json"
        return json.loads(path.read_text()) if path.is_file() else []

    @cached_property
    def config(self) -> dict[str, Any]:
        """The resolved config (from ``config_json`` in final.parquet), possibly empty."""
        try:
            return json.loads(self.final.get("config_json") or "{}")
        except ValueError:
            return {}

    def setting(self, section: str, key: str, default: Any) -> Any:
        """A config value of this run, falling back to the final row, then ``default``."""
        value = self.config.get(section, {}).get(key)
        if value is None:
            value = self.final.get({"noise_multiplier": "noise_multiplier",
                                    "clip_norm": "clip_norm"}.get(key, "\0"))
        return default if value is None else value


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every run folder (a folder holding ``final.parquet``) under the given paths."""
    runs: list[Run] = []
    seen: set[Path] = set()
    for p in paths:
        root = Path(p).expanduser()
        if not root.exists():
            raise UserError(f"results path not found: {root}")
        files = [root] if root.is_file() else sorted(root.rglob("final.parquet"))
        for f in files:
            folder = f.parent.resolve()
            if folder in seen:
                continue
            seen.add(folder)
            try:
                rows = pq.read_table(f).to_pylist()
            except (pa.ArrowException, OSError) as exc:  # truncated or unreadable: name it
                raise UserError(f"{f}: unreadable results file ({short_reason(exc)}); restore "
                                "it, or delete the run folder to run it again") from None
            if rows:
                runs.append(Run(folder=folder, final=rows[0]))
    return runs


def method_key(label: str) -> tuple[int, str]:
    """Sort key putting methods in the paper's column order (unknown ones last, by name)."""
    base = label.split(" ", 1)[0]
    return (METHOD_ORDER.index(base) if base in METHOD_ORDER else len(METHOD_ORDER), label)


def fmt(x: float, digits: int = 4) -> str:
    """A number for a table cell: NaN as an em dash, infinity as ∞."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}f}"


def mixed_starting_models(runs: Iterable[Run]) -> list[str]:
    """One warning per architecture whose runs started from more than one model, read from their
    ``provenance.json`` (runs without one, made before it existed, are not counted): runs of a
    table are compared as if they shared their start, so a difference between them would mix
    the methods' effect with the models' (a study resumed on a machine that rebuilt the model)."""
    models: dict[str, dict[str, list[str]]] = {}
    for run in runs:
        path = run.folder / "provenance.json"
        if not path.is_file():
            continue
        sha = json.loads(path.read_text())["starting_model"]["model_sha256"]
        models.setdefault(run.arch, {}).setdefault(str(sha), []).append(run.folder.name)
    return [f"the {arch} runs start from {len(by)} different models (provenance.json): "
            + "; ".join(f"{sha[:12]}: {len(names)} run(s), e.g. {names[0]}"
                        for sha, names in sorted(by.items()))
            for arch, by in sorted(models.items()) if len(by) > 1]

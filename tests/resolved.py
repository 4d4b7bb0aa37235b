"""Tests stand at a run's entrance: the configs they hand to the engine, data, models, sizing and
pretraining are resolved first, as ``commands.load_checked`` and ``run_training`` do."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from cluster_fl.config import Config, load_config
from cluster_fl.models.registry import resolve_shapes


def resolved_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """``load_config`` then the entrance's resolution (``data.n_mels`` from the model)."""
    return resolve_shapes(load_config(path, overrides))

"""Atomic checkpoints and clean stops.

A checkpoint is taken at a round boundary and holds everything a resumed run needs to continue
bit for bit: the global trainable state, the server optimiser, the clipping policy's adaptive
state, the accountant's ledger, the metric rows so far and the round number. Randomness needs no
saving: every draw derives from (seed, round, client). SIGTERM and SIGUSR2 (SLURM's pre-emption
warning) set a flag; the round loop checkpoints at the next round boundary and exits.
"""

from __future__ import annotations

import io
import signal
from pathlib import Path
from typing import Any

import torch

from cluster_fl.engine.rundir import atomic_write_bytes

CHECKPOINT_NAME = "state.pt"


def save_checkpoint(folder: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``folder/checkpoint/state.pt`` atomically (tmp + fsync + rename)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    path = Path(folder) / "checkpoint" / CHECKPOINT_NAME
    atomic_write_bytes(path, buf.getvalue())
    return path


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The last checkpoint of the run in ``folder``, or None."""
    path = Path(folder) / "checkpoint" / CHECKPOINT_NAME
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


class StopFlag:
    """Set by SIGTERM / SIGUSR2; read at round boundaries. Installs handlers on enter."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    @property
    def set(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> "StopFlag":
        for s in self.SIGNALS:
            try:
                self._previous[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread (e.g. submitit debug executor)
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

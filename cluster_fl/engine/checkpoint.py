"""Atomic checkpoints and clean stops.

A checkpoint is taken at a round boundary and holds everything a resumed run needs to continue
bit for bit: the global trainable state, the server optimiser, the clipping policy's adaptive
state, the accountant's ledger, the metric rows so far and the round number. Randomness needs no
saving: every draw derives from (seed, round, client). SIGTERM and SIGUSR2 (SLURM's pre-emption
warning) set a flag; the round loop checkpoints at the next round boundary and exits. Outside the
round loop (setup, the final evaluation) there is nothing to finish: the flag is *immediate* there
and the handler raises :class:`Stopped` at once, since the last checkpoint already holds the state.
A checkpoint that cannot be read (truncated, not ours) is a one-line error naming the file.
"""

from __future__ import annotations

import io
import signal
from pathlib import Path
from typing import Any

# torch is imported where it is used: ``train`` installs the stop handlers before the heavy
# imports, so a signal during start-up is already a clean stop
from cluster_fl.engine.rundir import atomic_write_bytes
from cluster_fl.errors import UserError, short_reason

CHECKPOINT_NAME = "state.pt"
CHECKPOINT_KEYS = ("round", "state", "server", "policy", "ledger", "rows")


def save_run_checkpoint(folder: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``folder/checkpoint/state.pt`` atomically (tmp + fsync + rename)."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    path = Path(folder) / "checkpoint" / CHECKPOINT_NAME
    atomic_write_bytes(path, buf.getvalue())
    return path


def load_run_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The last checkpoint of the run in ``folder``, or None."""
    import torch

    path = Path(folder) / "checkpoint" / CHECKPOINT_NAME
    if not path.is_file():
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated zip, foreign pickle, ...: never a traceback
        reason = short_reason(exc)
        raise UserError(f"checkpoint {path} is unreadable ({reason}); restore it, or delete "
                        f"{path.parent} to restart the run from round 1") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} is not a cluster-fl checkpoint (no "
                        f"{', '.join(missing)}); restore it, or delete {path.parent} to restart "
                        "the run from round 1")
    return ckpt


class Stopped(BaseException):
    """A stop signal outside the round loop. A ``BaseException``, like ``KeyboardInterrupt``,
    so that no ``except Exception`` on the way (a cache reader, a retry) swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopFlag:
    """Set by SIGTERM / SIGUSR2; read at round boundaries. Installs handlers on enter.

    ``immediate`` (see :meth:`set_immediate`): the handler also raises :class:`Stopped`, for the
    stretches where stopping at once loses nothing (setup, the final evaluation)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self, immediate: bool = False) -> None:
        self.signum: int | None = None
        self.immediate = immediate
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        if self.immediate:
            raise Stopped(signum)

    def set_immediate(self, immediate: bool) -> None:
        """Switch modes; a signal that arrived while deferred stops at once when switching on."""
        self.immediate = immediate
        if immediate and self.signum is not None:
            raise Stopped(self.signum)

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

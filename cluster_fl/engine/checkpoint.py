"""Atomic checkpoints and clean stops.

A checkpoint is taken at a round boundary and holds everything a resumed run needs to continue
bit for bit: the global trainable state, the server optimiser, the clipping policy's adaptive
state, the accountant's ledger, the metric rows so far and the round number. Randomness needs no
saving: every draw derives from (seed, round, client). SIGTERM and SIGUSR2 (SLURM's pre-emption
warning) set a flag; the round loop checkpoints at the next round boundary and exits. Outside the
round loop (setup, the final evaluation) there is nothing to finish: the flag is *immediate* there
and the handler raises :class:`Stopped` at once, since the last checkpoint already holds the state.
Only the first stop signal acts: a second one while the first is being handled (a scheduler that
sends SIGTERM twice) is noted and ignored, so it can neither interrupt the writing of the final
status nor change the exit code.

A resume trusts only what it verifies. A checkpoint carries the id of its run (the folder's
name), the run's nonce (drawn at its first start, also in config.yaml and privacy.json), its
round, the SHA-256 of its trainable state and one SHA-256 over everything it holds (metric rows,
clipping policy, server and ledger state included); :func:`load_run_checkpoint` checks the zip's
CRC of every member (``zipfile.testzip``: ``torch.load`` does not), loads it as data only
(``weights_only=True``: a pickle that would run code is refused unread), checks both digests,
the run id, the nonce and the round before anything is used. A checkpoint that is unreadable,
not ours, of another run, of a round the run cannot have, or damaged is a one-line error naming
the file; so is anything at ``checkpoint/state.pt`` that is not a file (:func:`check_checkpoint_path`,
called before the run touches its folder). The digests detect damage, not a forger: whoever can
write the folder can recompute them (the nonce catches a copied run, not a crafted one).
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import zipfile
from pathlib import Path
from typing import Any

# torch is imported where it is used: ``train`` installs the stop handlers before the heavy
# imports, so a signal during start-up is already a clean stop
from cluster_fl.engine.rundir import atomic_write_bytes
from cluster_fl.errors import UserError, short_reason

CHECKPOINT_NAME = "state.pt"
CONTENT_KEY = "checkpoint_sha256"  # over every other entry
CHECKPOINT_KEYS = ("round", "state", "server", "policy", "ledger", "rows")
VERIFY_KEYS = ("run_id", "state_sha256")  # what a resume checks the checkpoint against


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a trainable state: every tensor's name, dtype, shape and bytes, by name."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def content_digest(obj: Any) -> str:
    """SHA-256 of a checkpoint's contents: nested dicts (by sorted key), lists, tensors (dtype,
    shape, bytes) and plain values, each tagged with its type."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h: Any, x: Any) -> None:
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        h.update(f"T|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        h.update(f"D{len(x)}|".encode())
        for k in sorted(x, key=repr):
            _feed(h, k)
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__[0]}{len(x)}|".encode())
        for v in x:
            _feed(h, v)
    elif x is None or isinstance(x, (bool, int, float, str, bytes)):
        h.update(f"{type(x).__name__}:{x!r}|".encode())
    else:
        raise TypeError(f"a checkpoint holds data only, not {type(x).__name__}")


def check_checkpoint_path(folder: Path) -> None:
    """Anything at ``checkpoint/state.pt`` (or at ``checkpoint``) that is not what a checkpoint
    writer leaves -- a folder, a socket, a file where the folder should be -- is a one-line error:
    read as "no checkpoint", round 1 would run again over the run's released rows."""
    where = Path(folder) / "checkpoint"
    path = where / CHECKPOINT_NAME
    fix = f"move it away, or delete {where} to restart the run from round 1"
    if where.exists() and not where.is_dir():
        raise UserError(f"{where} is not a folder; {fix}")
    if os.path.lexists(path) and not path.is_file():
        raise UserError(f"checkpoint {path} is not a checkpoint file; {fix}")


def save_run_checkpoint(folder: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``folder/checkpoint/state.pt`` atomically (tmp + fsync + rename),
    stamped with the run's id (the folder's name), the digest of its trainable state and the
    digest of everything it holds."""
    import torch

    stamped = dict(state, run_id=Path(folder).name, state_sha256=state_digest(state["state"]))
    stamped[CONTENT_KEY] = content_digest(stamped)
    buf = io.BytesIO()
    torch.save(stamped, buf)
    path = Path(folder) / "checkpoint" / CHECKPOINT_NAME
    atomic_write_bytes(path, buf.getvalue())
    return path


def load_run_checkpoint(folder: Path, rounds: int | None = None, nonce: str | None = None,
                        check_nonce: bool = False) -> dict[str, Any] | None:
    """The last checkpoint of the run in ``folder``, verified (module docstring), or None.
    ``rounds``: the run's ``fl.rounds``, which the checkpoint's round may not exceed;
    ``check_nonce``: the checkpoint must carry ``nonce`` (the run's, from config.yaml)."""
    import torch

    path = Path(folder) / "checkpoint" / CHECKPOINT_NAME
    check_checkpoint_path(folder)
    if not path.is_file():
        return None
    fix = f"restore it, or delete {path.parent} to restart the run from round 1"
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()  # reads every member and checks its CRC-32
        if bad is not None:
            raise UserError(f"checkpoint {path} is damaged (member {bad} fails its CRC check); "
                            f"{fix}")
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # no code runs
    except UserError:
        raise
    except Exception as exc:  # truncated zip, foreign pickle, ...: never a traceback
        reason = short_reason(exc)
        raise UserError(f"checkpoint {path} is unreadable ({reason}); {fix}") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} is not a cluster-fl checkpoint (no "
                        f"{', '.join(missing)}); {fix}")
    unstamped = [k for k in VERIFY_KEYS if k not in ckpt]
    if unstamped:
        raise UserError(f"checkpoint {path} carries no {' or '.join(unstamped)} (written by an "
                        f"older cluster-fl): it cannot be verified; {fix}")
    if CONTENT_KEY in ckpt:  # absent in checkpoints of cluster-fl before the privacy review
        rest = {k: v for k, v in ckpt.items() if k != CONTENT_KEY}
        try:
            whole = content_digest(rest)
        except TypeError as exc:
            raise UserError(f"checkpoint {path} is not a cluster-fl checkpoint ({exc}); "
                            f"{fix}") from None
        if whole != ckpt[CONTENT_KEY]:
            raise UserError(f"checkpoint {path} is damaged (its contents do not match their "
                            f"SHA-256); {fix}")
    if ckpt["run_id"] != Path(folder).name:
        raise UserError(f"checkpoint {path} belongs to run {ckpt['run_id']!r}, not to "
                        f"{Path(folder).name!r} (copied from another run folder?); {fix}")
    if check_nonce and ckpt.get("run_nonce") != nonce:
        raise UserError(f"checkpoint {path} belongs to another run (nonce "
                        f"{ckpt.get('run_nonce')!r}, the folder's config.yaml says {nonce!r}: "
                        f"copied from another run folder?); {fix}")
    r = ckpt["round"]
    if not isinstance(r, int) or r < 1 or (rounds is not None and r > rounds) or \
            any(row.get("round", 0) > r for row in ckpt["rows"]):
        raise UserError(f"checkpoint {path} is of round {r!r}, which a run of {rounds} rounds "
                        f"cannot have written; {fix}")
    try:
        digest = state_digest(ckpt["state"])
    except Exception as exc:  # noqa: BLE001 - a state that is not tensors is damaged too
        raise UserError(f"checkpoint {path} holds no trainable state ({short_reason(exc)}); "
                        f"{fix}") from None
    if digest != ckpt["state_sha256"]:
        raise UserError(f"checkpoint {path} is damaged (its trainable state does not match its "
                        f"SHA-256); {fix}")
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

    def __init__(self, immediate: bool = False, ignore_after_stop: bool = False) -> None:
        self.signum: int | None = None
        self.repeats = 0  # stop signals after the first (ignored)
        self.immediate = immediate
        # the process's outermost flag (the CLI): once the run has stopped, later signals of the
        # same kind are moot; leaving them ignored keeps the exit code the run decided on
        self.ignore_after_stop = ignore_after_stop
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:  # already stopping: a repeat must not interrupt the shutdown
            self.repeats += 1
            return
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

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # a signal here, or the run leaving by an exception (preempted, failed): the process is
        # ending with an outcome already recorded
        stopping = self.signum is not None or exc_type is not None
        for s, h in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.ignore_after_stop and stopping else h)

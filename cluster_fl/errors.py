"""Errors meant for the user: the CLI prints them as one line and exits with code 2; and the
exit code every layer agrees on for a run stopped by a signal after its checkpoint."""

# EX_TEMPFAIL: the run checkpointed on a stop signal (SIGTERM, SLURM's preemption); resubmit it
# to continue. The engine exits with it, the grid's packs and the demo read it.
PREEMPTED_EXIT = 75


class UserError(Exception):
    """Bad input a user can fix (a config value, a missing file, a corrupt corpus row)."""


def short_reason(exc: BaseException, limit: int = 160) -> str:
    """The gist of a library's error message for a one-line report: its first sentence."""
    text = (str(exc).strip().splitlines() or [""])[0].split(". ")[0].strip() or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"

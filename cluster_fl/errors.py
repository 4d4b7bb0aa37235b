"""Errors meant for the user: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input a user can fix (a config value, a missing file, a corrupt corpus row)."""


def short_reason(exc: BaseException, limit: int = 160) -> str:
    """The gist of a library's error message for a one-line report: its first sentence."""
    text = (str(exc).strip().splitlines() or [""])[0].split(". ")[0].strip() or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"

"""The checks every config key's validation is written with: each raises :class:`ConfigError`
naming the key and what is allowed (the CLI prints it as one line and exits with 2)."""

from __future__ import annotations

import math
from typing import Any, Iterable

from cluster_fl.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem, phrased for the user: names the key and what is allowed."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


def check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def one_of(value: Any, allowed: Iterable[Any], key: str) -> None:
    allowed = tuple(allowed)
    check(value in allowed, key, f"got {value!r}; allowed: {', '.join(map(str, allowed))}")


def in_range(value: Any, key: str, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False, integer: bool = False) -> None:
    if integer:
        check(isinstance(value, int) and not isinstance(value, bool), key,
               f"got {value!r}; must be an integer")
    else:
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key,
               f"got {value!r}; must be a number")
        check(math.isfinite(value), key, f"got {value!r}; must be finite")
    lo_s = "-inf" if lo is None else repr(lo)
    hi_s = "inf" if hi is None else repr(hi)
    rng = f"{'(' if lo_open else '['}{lo_s}, {hi_s}{')' if hi_open else ']'}"
    ok = True
    if lo is not None:
        ok &= value > lo if lo_open else value >= lo
    if hi is not None:
        ok &= value < hi if hi_open else value <= hi
    check(ok, key, f"got {value!r}; allowed range {rng}")

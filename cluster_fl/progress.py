"""What a person watching a terminal sees of long work: durations, ETAs and progress bars.

Two tools, shared by every layer:

* :class:`Clock` -- elapsed time, the last step's duration and an ETA from the mean step time of
  this process (a resumed run's ETA counts only the rounds it has run itself);
* :func:`progress` -- wraps an iterable: a tqdm bar when stderr is a terminal, and otherwise
  (a job log, a pipe) a plain line every ``every_s`` seconds and one at the end, so a log file
  shows progress without a bar's carriage returns (a phase shorter than ``every_s`` says nothing).

Durations are for the screen only. A run folder never holds them: a round's wall time is a side
channel of the clients' work (``engine/operator_log.py`` keeps it for the operator).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")


def format_duration(seconds: float) -> str:
    """``0:07``, ``12:05``, ``1:02:03``: minutes and seconds, hours when there are any."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    total = int(round(max(0.0, seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Clock:
    """Elapsed time, the last step's time and the ETA of ``total`` steps, of which ``done``
    were finished before this clock started (a resumed run)."""

    def __init__(self, total: int, done: int = 0, now: Callable[[], float] = time.perf_counter):
        self.total, self.done, self.now = total, done, now
        self.start = self.last = now()
        self.steps = 0  # steps timed by this clock
        self.step_s = 0.0

    def tick(self) -> None:
        """One step finished."""
        t = self.now()
        self.step_s, self.last = t - self.last, t
        self.steps += 1
        self.done += 1

    @property
    def elapsed_s(self) -> float:
        return self.last - self.start

    @property
    def eta_s(self) -> float:
        """Remaining steps times the mean step time so far (nan before the first step)."""
        if not self.steps:
            return float("nan")
        return max(0, self.total - self.done) * self.elapsed_s / self.steps

    def line(self, unit: str = "round") -> str:
        """``elapsed 1:23, ETA 3:10, round 8.2 s``."""
        return (f"elapsed {format_duration(self.elapsed_s)}, ETA {format_duration(self.eta_s)}, "
                f"{unit} {self.step_s:.3g} s")


def on_terminal(stream: TextIO | None = None) -> bool:
    """True when ``stream`` (stderr by default) is an interactive terminal."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress(items: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it",
             every_s: float = 30.0, stream: TextIO | None = None, enabled: bool = True,
             now: Callable[[], float] = time.perf_counter) -> Iterator[T]:
    """``items``, with a progress bar on a terminal and plain lines elsewhere (module docstring);
    nothing at all when not ``enabled`` (e.g. on ranks other than 0)."""
    if not enabled:
        yield from items
        return
    stream = stream if stream is not None else sys.stderr
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if on_terminal(stream):
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=desc, unit=unit, file=stream, leave=False,
                        dynamic_ncols=True)
        return
    start = last = now()
    done = 0

    def say(final: bool = False) -> None:
        t = now() - start
        of = f"/{total}" if total else ""
        rate = f", {done / t:.3g} {unit}/s" if t > 0 and done else ""
        eta = ""
        if total and done and not final:
            eta = f", ETA {format_duration((total - done) * t / done)}"
        print(f"{desc}: {done}{of} {unit}, elapsed {format_duration(t)}{rate}{eta}"
              + (" (done)" if final else ""), file=stream, flush=True)

    said = False
    for item in items:
        yield item
        done += 1
        if now() - last >= every_s and (total is None or done < total):
            last, said = now(), True
            say()
    if said:  # a phase shorter than every_s leaves no line
        say(final=True)


class Tally:
    """Progress of ``total`` things that finish out of order (a grid's runs): a bar on a terminal,
    and off one a plain line each time the summary text changes."""

    def __init__(self, total: int, desc: str, unit: str = "run", stream: TextIO | None = None,
                 now: Callable[[], float] = time.perf_counter):
        self.total, self.desc, self.unit, self.now = total, desc, unit, now
        self.stream = stream if stream is not None else sys.stderr
        self.start = now()
        self.text = None
        self.bar = None
        if on_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False,
                            dynamic_ncols=True)

    def update(self, done: int, text: str) -> None:
        """``done`` of the total are finished; ``text`` says how the rest stand."""
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(text, refresh=True)
            return
        if text != self.text:
            self.text = text
            print(f"{self.desc}: {done}/{self.total} {self.unit}s finished ({text}), elapsed "
                  f"{format_duration(self.now() - self.start)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

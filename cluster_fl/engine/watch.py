"""What a person watching a run sees, and what its trackers receive.

:class:`Log` writes the run's lines (rank 0): every one to stderr and to the run's log.txt, with
``screen`` text -- a round's elapsed time, ETA and duration -- on stderr alone. :class:`Watch`
keeps the run's clock (:class:`~cluster_fl.progress.Clock`), its performance
(:mod:`cluster_fl.engine.performance`) and its trackers (:mod:`cluster_fl.engine.trackers`):
the round line with its timings, the released row to the trackers, the performance summary to
the screen and the operator log. Nothing here writes a time into the run folder.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from cluster_fl.engine.performance import Performance
from cluster_fl.engine.rundir import append_text
from cluster_fl.engine.trackers import Trackers
from cluster_fl.progress import Clock, on_terminal


class Log:
    """Rank-0 progress: one line per event to stderr and to the run's log.txt. Only a
    non-private run stamps its stderr lines with the time of day: times are a side channel of
    the clients' work, and a scheduler keeps stderr in its job logs (the operator log has them).
    ``screen`` (a round's elapsed time, ETA and duration; the run's performance) goes to stderr
    only, never log.txt: always in a non-private run, in a private one only when stderr is a
    terminal -- the operator's screen, not a job log."""

    def __init__(self, folder: Path | None, enabled: bool, stamp: bool = True):
        self.path = folder / "log.txt" if folder is not None else None
        self.enabled = enabled
        self.stamp = stamp

    def __call__(self, msg: str, echo: bool = True, screen: str = "") -> None:
        if not self.enabled:
            return
        if echo:
            when = f"[{time.strftime('%H:%M:%S')}] " if self.stamp else ""
            extra = f" | {screen}" if screen and self.shows_times else ""
            print(f"{when}{msg}{extra}", file=sys.stderr, flush=True)
        if self.path is not None:
            append_text(self.path, msg + "\n")

    @property
    def shows_times(self) -> bool:
        """Whether durations may reach stderr (class docstring)."""
        return self.stamp or on_terminal()

    def screen(self, msg: str) -> None:
        """A line for stderr only, never log.txt (the run's timings; see the class docstring)."""
        if self.enabled and self.shows_times:
            when = f"[{time.strftime('%H:%M:%S')}] " if self.stamp else ""
            print(f"{when}{msg}", file=sys.stderr, flush=True)


class Watch:
    """This attempt's clock, performance and trackers (rank 0 reports; every rank may hold one)."""

    def __init__(self, world: Any, rounds: int):
        self.clock = Clock(rounds)
        self.perf = Performance.of(world)
        self.trackers = Trackers((), Path("."), {})

    def open(self, report_to: Any, folder: Path, config: Mapping[str, Any], main: bool,
             rounds: int, start_round: int) -> None:
        """Open the trackers (with the recorded config) and start the clock at the first round."""
        self.trackers = Trackers(report_to, folder, config, enabled=main)
        self.clock = Clock(rounds, done=start_round - 1)

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Time an evaluation (its share of the run in the performance summary)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.perf.evaluation_s += time.perf_counter() - t0

    def round(self, r: int, line: str, row: Mapping[str, Any], operator: Mapping[str, Any],
              log: Log) -> None:
        """Round ``r`` is over: its line (timings on the screen only), its released row to the
        trackers, its operator facts to the performance summary."""
        self.clock.tick()
        self.perf.add_round(operator, row)  # a private run counts the public cohort
        log(line, screen=self.clock.line())
        self.trackers.log_round(r, row)  # the released row, nothing of the operator's

    def final(self, last: int, final: Mapping[str, Any], log: Log, oplog: Any) -> None:
        """The final row to the trackers; the performance summary to the screen (where timings
        may go: :class:`Log`) and always to the operator log."""
        self.trackers.log_final(last, final)
        for line in self.perf.summary():
            log.screen(line)
            oplog("performance", message=line)

    def close(self) -> None:
        self.trackers.close()

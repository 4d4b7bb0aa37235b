"""What a run shows on the screen and what it keeps out of its folder: every round line carries
``round r/R``, the test WER when evaluated, elapsed time, ETA and the round's time on stderr --
the run's log.txt gets the same line without the times (a side channel of the clients' work) --
and the run ends with a performance summary (updates/s, the shares of a round, FLOP/s) on the
screen and in the operator log, never in the run folder. A private run shows times on a
terminal only: its stderr off a terminal is a scheduler's job log, which keeps no times."""

from __future__ import annotations

import re

from engine_helpers import tiny_config

from cluster_fl.engine.operator_log import read_operator_log
from cluster_fl.engine.train import run_training


def test_round_lines_show_progress_on_screen_and_the_folder_keeps_released_values(
        tiny_corpus, tmp_path, capsys):
    folder = run_training(tiny_config(tiny_corpus, tmp_path, "eval.every=1",
                                      "privacy.mechanism=none"))
    err = capsys.readouterr().err
    screen = [line for line in err.splitlines() if re.search(r"\] round \d/2: ", line)]
    assert len(screen) == 2, err[-2000:]
    assert "round 1/2: test WER " in screen[0]  # evaluated rounds carry their WER on the line
    for line in screen:
        assert re.search(r"\| elapsed \d+:\d\d, ETA \d+:\d\d, round [\d.e+-]+ s$", line), line
    logged = [line for line in (folder / "log.txt").read_text().splitlines()
              if line.startswith("round ")]
    assert len(logged) == 2 and logged[0].startswith("round 1/2: test WER ")
    assert not any(w in line for line in logged for w in ("elapsed", "ETA", " s/"))
    perf = [line for line in err.splitlines() if "performance:" in line]
    assert any("updates/s" in line for line in perf), err[-2000:]
    shares = next(line for line in perf if "time in" in line)
    names = re.findall(r"(client steps|noise|secure sum|evaluation|other) (\d+)%", shares)
    assert [n for n, _ in names] == ["client steps", "noise", "secure sum", "evaluation", "other"]
    assert 98 <= sum(int(p) for _, p in names) <= 102  # shares of one total (rounding)
    assert any("TFLOP/s" in line and "peak not known" in line for line in perf)  # a CPU
    assert "client updates on this rank's lane" in perf[0]  # a non-private run: the exact count
    assert "performance" not in (folder / "log.txt").read_text()
    events = [e for e in read_operator_log(folder) if e["event"] == "performance"]
    assert [e["message"] for e in events] == [line.split("] ", 1)[1] for line in perf]


def test_a_private_run_keeps_times_off_a_job_log_and_gives_them_to_the_operator(
        tiny_corpus, tmp_path, capsys):
    folder = run_training(tiny_config(tiny_corpus, tmp_path, "eval.every=1"))  # DP, stderr no tty
    err = capsys.readouterr().err
    rounds = [line for line in err.splitlines() if re.match(r"round \d/2: ", line)]
    assert len(rounds) == 2 and rounds[0].startswith("round 1/2: test WER ")
    assert not re.search(r"elapsed|ETA|performance:|\[\d\d:\d\d:\d\d\]", err), err[-2000:]
    events = [e["message"] for e in read_operator_log(folder) if e["event"] == "performance"]
    assert any("expected client updates (the public cohort size q·N)" in m for m in events)
    assert any("time in client steps" in m for m in events)

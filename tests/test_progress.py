"""cluster_fl/progress.py: durations, the ETA of a clock, and plain progress lines off a
terminal (a bar on one). Clocks are fakes: nothing here depends on the machine's speed."""

from __future__ import annotations

import io

from cluster_fl.engine.performance import FlopCounter, Performance
from cluster_fl.progress import Clock, format_duration, progress


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_durations_read_as_minutes_and_hours():
    assert format_duration(7.4) == "0:07"
    assert format_duration(725) == "12:05"
    assert format_duration(3723) == "1:02:03"
    assert format_duration(float("nan")) == "?"


def test_the_eta_is_the_remaining_rounds_at_this_attempts_mean_round_time():
    now = FakeTime()
    clock = Clock(10, done=4, now=now)  # resumed after round 4: only its own rounds are timed
    now.t += 3.0
    clock.tick()
    now.t += 5.0
    clock.tick()
    assert clock.done == 6 and clock.step_s == 5.0 and clock.elapsed_s == 8.0
    assert clock.eta_s == 4 * 4.0
    assert clock.line() == "elapsed 0:08, ETA 0:16, round 5 s"
    assert Clock(3).line().startswith("elapsed 0:00, ETA ?")


def test_off_a_terminal_progress_prints_plain_lines_periodically_and_last():
    now, out = FakeTime(), io.StringIO()
    seen = []
    for i in progress(range(10), desc="decoding", unit="batch", every_s=30, stream=out, now=now):
        seen.append(i)
        now.t += 10.0  # a line every third item
    assert seen == list(range(10))
    lines = out.getvalue().splitlines()
    assert lines[-1] == "decoding: 10/10 batch, elapsed 1:40, 0.1 batch/s (done)"
    middle = lines[:-1]
    assert len(middle) == 3 and all("ETA" in line and "\r" not in line for line in middle)
    assert middle[0] == "decoding: 3/10 batch, elapsed 0:30, 0.1 batch/s, ETA 1:10"
    short = io.StringIO()  # a phase shorter than every_s: no line at all
    assert list(progress(range(3), desc="x", every_s=30, stream=short, now=FakeTime())) == [0, 1, 2]
    assert short.getvalue() == ""
    quiet = io.StringIO()
    assert list(progress(range(3), stream=quiet, enabled=False)) == [0, 1, 2]
    assert quiet.getvalue() == ""


def test_the_performance_summary_splits_the_rounds_time_by_phase():
    perf = Performance()
    for _ in range(2):
        perf.add_round({"trained": 5, "wall_s": 10.0, "t_clients": 6.0, "t_noise": 1.0, "t_sum": 2.0})
    perf.evaluation_s = 5.0
    lines = perf.summary()
    assert "10 client updates" in lines[0] and "0.5 updates/s" in lines[0]
    assert lines[1] == ("performance: time in client steps 48%, noise 8%, secure sum 16%, "
                        "evaluation 20%, other 8%")
    assert Performance().summary() == []


def test_a_private_run_counts_the_public_expected_cohort_never_the_realised_one():
    perf = Performance(private=True)
    for trained in (23, 26):  # the realised cohorts: exact, released only noised
        perf.add_round({"trained": trained, "wall_s": 10.0, "t_clients": 9.0},
                       {"denominator": 24.0})
    line = perf.summary()[0]
    assert "48 expected client updates (the public cohort size q·N)" in line
    assert "49" not in line and "2.4 updates/s" in line


def test_flops_count_encoder_frames_and_decoder_positions():
    class Model:
        class connector:
            stack = 2

        def audio_token_counts(self, lengths):
            return [n // 4 for n in lengths]

        def target_counts(self, texts):
            return [len(t) + 1 for t in texts]

    counter = FlopCounter(encoder_params=10, decoder_params=100, model=Model())
    counter.count([40, 80], ["ab", "c"])  # audio 10 + 20, targets 3 + 2
    assert counter.flops == 6.0 * (10 * 60 + 100 * (30 + 5))

"""What a private run says outside its folder: stderr (kept by schedulers in job logs)
carries no time of day and no exact counts, status.json and log.txt name an unexpected error's
type only, and the operator log that does hold the exact facts is its owner's alone."""

from __future__ import annotations

import json
import re
import stat

from cluster_fl.config import load_config
from cluster_fl.engine.operator_log import OperatorLog, operator_path
from cluster_fl.engine.rundir import write_status
from cluster_fl.engine.train import Log, _record_end


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_private_runs_operator_warning_reaches_stderr_without_its_counts(tmp_path, capsys):
    folder = tmp_path / "exp" / "run"
    folder.mkdir(parents=True)
    OperatorLog(folder, True, private=True).warn("round 3: no client contributed (cohort 7)")
    err = capsys.readouterr().err
    assert "cohort 7" not in err and "operator warning" in err
    assert "cohort 7" in operator_path(folder).read_text()
    OperatorLog(folder, True, private=False).warn("round 4: cohort 9")
    assert "cohort 9" in capsys.readouterr().err  # a non-private run's terminal may show it


def test_the_operator_log_is_its_owners_alone(tmp_path):
    folder = tmp_path / "exp" / "run"
    folder.mkdir(parents=True)
    (tmp_path / "exp" / ".operator").mkdir(mode=0o755)  # left wide by an older version
    OperatorLog(folder, True)("round", round=1, cohort=4)
    assert _mode(operator_path(folder).parent) == 0o700
    assert _mode(operator_path(folder)) == 0o600


def test_a_private_runs_stderr_lines_carry_no_time_of_day(tmp_path, capsys):
    Log(tmp_path, True, stamp=False)("round 1/3 loss 0.5")
    err = capsys.readouterr().err
    assert not re.search(r"\d{2}:\d{2}:\d{2}", err) and "round 1/3" in err
    Log(tmp_path, True)("round 2/3")
    assert re.search(r"\[\d{2}:\d{2}:\d{2}\]", capsys.readouterr().err)


def test_a_private_runs_status_names_an_unexpected_errors_type_only(tmp_path):
    folder = tmp_path / "exp" / "run"
    folder.mkdir(parents=True)
    cfg = load_config(None, [])  # DP-FedAvg, research mode
    write_status(folder, "running", 1, 3)
    _record_end(folder, cfg, RuntimeError("client 17 has 3 utterances"), False, 1,
                Log(folder, True, stamp=False))
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "failed" and status["error"].startswith("RuntimeError")
    assert "client 17" not in status["error"]
    assert "client 17" not in (folder / "log.txt").read_text()
    assert "client 17" in operator_path(folder).read_text()


def test_a_private_run_keeps_unusable_utterance_ids_off_stderr():
    import warnings

    from cluster_fl.data.mls import report_problem
    from cluster_fl.engine.train import quiet_data_warnings

    def shown(*overrides: str) -> list[str]:
        errors: list[dict] = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet_data_warnings(load_config(None, list(overrides))):
                report_problem(errors, "spk7_utt3", "shard.parquet", "cannot decode")
        assert errors[0]["utterance_id"] == "spk7_utt3"  # kept for the operator log
        return [str(w.message) for w in seen]

    assert not any("spk7_utt3" in m for m in shown())  # DP-FedAvg
    assert any("spk7_utt3" in m for m in shown("privacy.mechanism=none"))

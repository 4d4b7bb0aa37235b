"""The budget ``train`` keeps: σ from ``privacy.target_epsilon`` when σ is unset, a σ
that passes the target refused, ``privacy.max_epsilon`` stopping a run cleanly before the round
that would pass it (and a resume stopping there too), and what is said at start."""

from __future__ import annotations

import json
from reliability_helpers import config_file, folder_of, one_line_error, status, train_in_process

from cluster_fl.cli import main
from cluster_fl.config import load_config
from cluster_fl.engine.budget import start_notes
from cluster_fl.privacy import ledger_for


def test_train_derives_sigma_from_the_target_epsilon(tiny_corpus, tmp_path):
    extra = ("privacy.noise_multiplier=null", "privacy.target_epsilon=40")
    folder = train_in_process(tiny_corpus, tmp_path, *extra)
    record = json.loads((folder / "privacy.json").read_text())
    assert record["rounds"] == 3
    assert 0.99 * 40 <= record["epsilon"] <= 40  # the smallest σ that stays within the target
    stored = (folder / "config.yaml").read_text()
    assert f"noise_multiplier: {record['noise_multiplier']}" in stored  # the σ the run used
    train_in_process(tiny_corpus, tmp_path, *extra)  # the same config: finished, not refused
    assert status(folder)["state"] == "done"
    st = status(folder)  # killed before its final evaluation: the resume keeps the run's σ
    st.update(state="running")
    (folder / "status.json").write_text(json.dumps(st))
    (folder / "final.parquet").unlink()
    train_in_process(tiny_corpus, tmp_path, *extra)
    again = json.loads((folder / "privacy.json").read_text())
    assert again["noise_multiplier"] == record["noise_multiplier"]
    assert again["epsilon"] == record["epsilon"] and status(folder)["state"] == "done"


def test_a_sigma_that_passes_the_target_is_refused(tiny_corpus, tmp_path, capsys):
    config = config_file(tiny_corpus, tmp_path, "privacy.target_epsilon=0.001")  # σ 0.5
    assert main(["train", str(config)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "privacy.target_epsilon" in line and "privacy.noise_multiplier" in line, line
    assert not (folder_of(tiny_corpus, tmp_path, "privacy.target_epsilon=0.001")
                / "rounds.parquet").exists()


def test_max_epsilon_stops_before_the_round_that_would_pass_it(tiny_corpus, tmp_path,
                                                               reference, capsys):
    eps = [r["epsilon"] for r in reference["rounds"]]
    limit = (eps[1] + eps[2]) / 2  # round 3's charge would pass it
    extra = (f"privacy.max_epsilon={limit!r}",)
    config = config_file(tiny_corpus, tmp_path, *extra)
    assert main(["train", str(config)]) == 0
    assert "max_epsilon" in capsys.readouterr().err
    folder = folder_of(tiny_corpus, tmp_path, *extra)
    st = status(folder)
    assert st["state"] == "done" and st["round"] == 2 and "max_epsilon" in st["reason"]
    record = json.loads((folder / "privacy.json").read_text())
    assert record["rounds"] == 2 and record["epsilon"] <= limit
    assert (folder / "final.parquet").exists()
    assert main(["train", str(config)]) == 0  # a resubmission does not go past it
    assert json.loads((folder / "privacy.json").read_text())["rounds"] == 2


def test_sigma_zero_a_void_guarantee_and_random_init_are_said_at_start():
    def notes(*overrides):
        cfg = load_config(None, ["model.arch=whisper-tinyllama-tiny", *overrides])
        return "\n".join(start_notes(cfg, ledger_for(cfg, population=100)))

    zero = notes("privacy.noise_multiplier=0")
    assert "noise_multiplier is 0" in zero and "guarantee void" in zero
    assert "guarantee void" in notes("privacy.diagnostics=exact")
    assert "random init" in notes()
    assert "void" not in notes() and "random init" not in notes("model.checkpoint=/tmp/m")


def test_a_reset_adds_to_the_datasets_ledger_instead_of_forgetting(tiny_corpus, tmp_path):
    """Deleting privacy.json and the checkpoint (what a resume's error advises) restarts a run
    from round 1; the rounds released before the reset stay in the dataset's ledger."""
    from cluster_fl.engine.dataset_ledger import DIR, cumulative_epsilon

    folder = train_in_process(tiny_corpus, tmp_path)
    books = list((tmp_path / DIR).glob("*.json"))
    assert len(books) == 1
    first = json.loads(books[0].read_text())
    assert len(first["epochs"]) == 1
    run_eps = json.loads((folder / "privacy.json").read_text())["epsilon"]
    assert first["epsilon"] == run_eps  # one epoch: the run's own ε
    # the reset
    st = status(folder)
    st.update(state="running", round=3)
    (folder / "status.json").write_text(json.dumps(st))
    for name in ("privacy.json", "final.parquet"):
        (folder / name).unlink()
    import shutil

    shutil.rmtree(folder / "checkpoint")
    train_in_process(tiny_corpus, tmp_path)
    book = json.loads(books[0].read_text())
    assert len(book["epochs"]) == 2
    rounds = [sum(e["count"] for e in ep["state"]["events"]) for ep in book["epochs"].values()]
    assert rounds == [3, 3]
    assert book["epsilon"] > run_eps and book["epsilon"] == cumulative_epsilon(book, 1e-5)
    record = json.loads((folder / "privacy.json").read_text())
    assert record["epsilon"] == run_eps and record["dataset_epsilon"] == book["epsilon"]

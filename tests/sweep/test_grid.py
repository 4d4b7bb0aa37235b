"""`cluster-fl grid` / `status`: expansion, idempotent submission, local and debug clusters."""

import argparse
import shutil
from pathlib import Path

import pytest

from cluster_fl.cli import main
from cluster_fl.config import load_config
from cluster_fl.errors import UserError
from cluster_fl.commands import grid as grid_cmd
from cluster_fl.sweep import grid as grid_mod
from cluster_fl.sweep.gridspec import expand, load_grid
from cluster_fl.sweep import status
from fakes import fake_train, fake_wer, write_status

REPO = Path(__file__).resolve().parents[2]
METHODS = REPO / "configs" / "method"


def tiny_grid(tmp_path: Path, methods=("flat", "alpha-split"), seeds=(0, 1), corpus=None) -> Path:
    """``corpus``: a real one, for the commands whose pre-flight checks the inputs (the fake
    training of the other tests reads none)."""
    data = f", data.corpus: {corpus}, data.languages: [en, de, fr]" if corpus else ""
    text = f"""
experiment: t
out: {tmp_path / 'results'}
set: {{fl.rounds: 2, run.device: cpu{data}}}
axes:
  method:
""" + "".join(f"    - {{name: {m}, preset: {METHODS / (m + '.yaml')}}}\n" for m in methods) + f"""
seeds: {list(seeds)}
resources: {{array_parallelism: 2, time_min: 10}}
"""
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


def grid_args(path, cluster="debug", **kw):
    return argparse.Namespace(grid=str(path), cluster=cluster, dry_run=False, wait=True, out=None,
                              overrides=[], **kw)


def test_every_arch_and_method_preset_is_a_valid_config():
    for preset in sorted((REPO / "configs" / "arch").glob("*.yaml")) + sorted(METHODS.glob("*.yaml")):
        load_config(preset)
    assert {p.stem for p in (REPO / "configs" / "arch").glob("*.yaml")} >= {
        "whisper-tinyllama", "whisper-eurollm", "voxtral", "whisper-tinyllama-tiny",
        "whisper-eurollm-tiny", "voxtral-tiny"}


def test_paper_grid_is_the_papers_setting():
    grid = load_grid(REPO / "configs" / "grids" / "paper.yaml")
    specs = expand(grid)
    # 3 archs x (2 conditions x 7 methods - alpha-split on a frozen encoder) x 3 seeds
    assert len(specs) == 3 * (2 * 7 - 1) * 3
    assert len({s.run_id for s in specs}) == len(specs)
    cfg = specs[0].config
    fl = cfg.fl
    assert (fl.rounds, fl.clients_per_round, fl.local_epochs, fl.batch_size) == (40, 94, 10, 16)
    assert (cfg.privacy.clip_norm, cfg.privacy.noise_multiplier) == (1.0, 0.1)
    by_id = {s.run_id: s.config for s in specs}
    split = by_id["whisper-eurollm__unfrozen__alpha-split__s2"]
    assert (split.model.arch, split.model.freeze_encoder, split.privacy.clipping, split.run.seed) == (
        "whisper-eurollm", False, "alpha-split", 2)
    assert by_id["voxtral__frozen__fedavg__s0"].privacy.mechanism == "none"
    assert grid.resources.gpus_per_task == 1 and grid.resources.signal_delay_s == 120


def test_tiny_grid_expands_on_cpu():
    specs = expand(load_grid(REPO / "configs" / "grids" / "tiny.yaml"))
    assert len(specs) == 4 * 2
    assert all(s.config.model.arch == "whisper-tinyllama-tiny" and s.config.run.device == "cpu"
               for s in specs)


def test_a_bad_override_names_the_cell(tmp_path):
    with pytest.raises(Exception, match="flat.*privacy.alpha|privacy.alpha"):
        expand(load_grid(tiny_grid(tmp_path)), {"privacy.alpha": 2.0})


def test_resubmitting_a_finished_grid_submits_nothing_and_a_deleted_run_is_resubmitted(tmp_path, capsys,
                                                                                        tiny_corpus):
    path = tiny_grid(tmp_path, corpus=tiny_corpus)
    assert main(["grid", str(path), "--dry-run"]) == 0  # in the order submit uses: seed-major
    assert [line.split()[2] for line in capsys.readouterr().out.splitlines()
            if line.startswith("would submit")] == ["flat__s0", "alpha-split__s0", "flat__s1",
                                                    "alpha-split__s1"]
    assert grid_cmd.run(grid_args(path), train_fn=fake_train) == 0
    assert "submitted 4 runs" in capsys.readouterr().out
    assert grid_cmd.run(grid_args(path), train_fn=fake_train) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "submitted 0 runs to debug"
    grid = load_grid(path)
    todo, _ = grid_mod.pending_runs(grid)
    assert todo == []
    shutil.rmtree(grid.root / "alpha-split__s1")
    todo, states = grid_mod.pending_runs(grid)
    assert [s.run_id for s in todo] == ["alpha-split__s1"]
    assert dict((s.run_id, st) for s, st in states)["alpha-split__s1"] == "missing"
    assert main(["grid", str(path), "--cluster", "debug", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would submit alpha-split__s1" in out and out.count("would submit") == 1


def test_failed_runs_are_resubmitted_and_running_ones_with_a_live_job_are_not(tmp_path, monkeypatch):
    path = tiny_grid(tmp_path, methods=("flat",), seeds=(0, 1))
    grid = load_grid(path)
    write_status(grid.root / "flat__s0", "failed", 1, 2, error="boom")
    write_status(grid.root / "flat__s1", "running", 1, 2)
    status.write_registry(grid, {"flat__s1": {"cluster": "slurm", "job_id": "77_1", "host": "x"}})
    monkeypatch.setattr(status, "jobs_alive", lambda recs: {r: bool(v) for r, v in recs.items()})
    todo, states = grid_mod.pending_runs(grid)
    assert [s.run_id for s in todo] == ["flat__s0"]
    monkeypatch.setattr(status, "jobs_alive",
                        lambda recs: {r: False if v else None for r, v in recs.items()})
    todo, _ = grid_mod.pending_runs(grid)  # the job died without finishing: resubmit
    assert [s.run_id for s in todo] == ["flat__s0", "flat__s1"]


def test_tiny_grid_of_2_cells_x_2_seeds_runs_end_to_end_on_local_cluster_and_table_prints_all(
        tmp_path, capsys):
    path = tiny_grid(tmp_path)
    assert grid_cmd.run(grid_args(path, cluster="local"), train_fn=fake_train) == 0
    capsys.readouterr()
    assert main(["status", str(path)]) == 0
    assert "4        0        0        0        0  (4 runs)" in capsys.readouterr().out
    assert main(["table", str(tmp_path / "results"), "--format", "csv", "--bootstrap", "50"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 2
    rows = {line.split(",")[2]: line.split(",") for line in lines[1:]}
    assert rows["flat"][3] == "2" and rows["alpha-split α=0.05"][3] == "2"  # n seeds per cell
    cfg = load_config(None, ["privacy.clipping=flat", "run.seed=0"])
    expected = (fake_wer(cfg) + fake_wer(load_config(None, ["privacy.clipping=flat", "run.seed=1"]))) / 2
    assert float(rows["flat"][5]) == pytest.approx(expected)


def test_parallel_overrides_the_grids_array_parallelism_local_runs_in_waves_of_n_seed_major(
        tmp_path, monkeypatch):
    path = tiny_grid(tmp_path, seeds=(0, 1))  # the grid says 2 at a time
    waves: list[list[str]] = []
    real = grid_mod.make_executor

    def recording(grid, cluster):
        executor = real(grid, cluster)
        submit_array = executor.submit_array
        executor.submit_array = lambda tasks: (
            waves.append([t.config["run"]["run_id"] for t in tasks]), submit_array(tasks))[1]
        return executor

    monkeypatch.setattr(grid_mod, "make_executor", recording)
    assert grid_cmd.run(grid_args(path, cluster="local", parallel=3), train_fn=fake_train) == 0
    # whole seeds first: a grid stopped after its first wave has seed 0 of every method
    assert waves == [["flat__s0", "alpha-split__s0", "flat__s1"], ["alpha-split__s1"]]
    shutil.rmtree(tmp_path / "results")
    waves.clear()
    assert grid_cmd.run(grid_args(path, cluster="local"), train_fn=fake_train) == 0
    assert [len(w) for w in waves] == [2, 2]
    with pytest.raises(UserError, match="array_parallelism"):
        grid_cmd.run(grid_args(path, cluster="local", parallel=0), train_fn=fake_train)


def test_a_run_preempted_on_the_local_cluster_is_requeued_and_resumes_from_its_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CFL_FAKE_PREEMPT_AT", "1")  # the run sends itself USR2 after round 1
    path = tiny_grid(tmp_path, methods=("flat",), seeds=(0,))
    assert grid_cmd.run(grid_args(path, cluster="local"), train_fn=fake_train) == 0
    folder = load_grid(path).root / "flat__s0"
    assert (folder / "attempts.txt").read_text().split() == ["start", "0", "start", "1"]
    assert status.read_status(folder)["state"] == "done"


def broken_train(cfg):
    folder = Path(cfg.run.out) / cfg.run.experiment / str(cfg.run.run_id)
    write_status(folder, "running", 1, cfg.fl.rounds)
    raise ValueError("no private split in data.corpus")


def test_a_failed_run_is_reported_with_its_error_and_grid_wait_exits_1(tmp_path, capsys):
    path = tiny_grid(tmp_path, methods=("flat",), seeds=(0,))
    assert grid_cmd.run(grid_args(path), train_fn=broken_train) == 1
    out = capsys.readouterr().out
    assert "run flat__s0 failed: ValueError: no private split in data.corpus" in out
    recorded = status.read_status(load_grid(path).root / "flat__s0")
    assert recorded["state"] == "failed" and "no private split" in recorded["error"]
    assert main(["status", str(path)]) == 0
    assert "failed flat__s0: ValueError: no private split in data.corpus" in capsys.readouterr().out


def test_a_preempted_run_that_nobody_requeues_is_failed_with_the_round_it_stopped_at(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CFL_FAKE_PREEMPT_AT", "1")  # debug jobs run in this process: no requeue
    path = tiny_grid(tmp_path, methods=("flat",), seeds=(0,))
    assert grid_cmd.run(grid_args(path), train_fn=fake_train) == 1
    assert "run flat__s0 failed: stopped after round 1 of 2" in capsys.readouterr().out
    todo, _ = grid_mod.pending_runs(load_grid(path))
    assert [s.run_id for s in todo] == ["flat__s0"]
    assert grid_cmd.run(grid_args(path), train_fn=fake_train) == 0  # resubmitted: resumes, finishes
    assert (load_grid(path).root / "flat__s0" / "attempts.txt").read_text().split() == [
        "start", "0", "start", "1"]

"""Pre-flight: nothing doomed reaches the queue. Each bad input is one line
naming the cell and the key, the command exits 2 and nothing is submitted; a good grid's dry
run prints each job's resources and estimates; SLURM is asked only for ``--cluster slurm``
(stand-in ``sinfo``/``sbatch`` on PATH, tests/sweep/slurm_fakes.py; the real one in tests/slurm).

submitit is imported when this module is collected: imported first inside a test that captures
stderr (after the engine tests have imported torch's compiler), its logging setup binds that
test's capture and pytest's own capture breaks ("I/O operation on closed file"; seen before this
issue with any ``cli.main`` error after tests/engine/test_host_syncs.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import slurm_fakes  # noqa: E402
from hf_checkpoints import save_whisper_llama  # noqa: E402

import cluster_fl.sweep.grid  # noqa: E402,F401  -- submitit at collection (below)
from cluster_fl.cli import main  # noqa: E402
from cluster_fl.sweep import preflight as pf  # noqa: E402
from cluster_fl.sweep.gridspec import load_grid  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
METHODS = REPO / "configs" / "method"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Small save_pretrained Whisper + Llama (+ tokenizer) folders: real checkpoints' layout."""
    return save_whisper_llama(tmp_path_factory.mktemp("hf"))


def write_grid(tmp_path: Path, corpus, *, arch_set: str = "model.arch: whisper-tinyllama-tiny",
               resources: str = "", extra_set: str = "", seeds=(0, 1)) -> Path:
    text = f"""experiment: pre
out: {tmp_path / 'results'}
set:
  data.corpus: {corpus}
  data.languages: [en, de, fr]
  fl.rounds: 1
  fl.clients_per_round: 2
  run.device: cpu
  {arch_set}
{extra_set}axes:
  method:
    - {{name: flat, preset: {METHODS / 'flat.yaml'}}}
    - {{name: alpha-split, preset: {METHODS / 'alpha-split.yaml'}}}
seeds: {list(seeds)}
resources: {{time_min: 10{', ' + resources if resources else ''}}}
"""
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


def real_arch(hf: Path, encoder: str | None = None) -> str:
    return (f"model.arch: whisper-tinyllama\n  model.encoder_path: {encoder or hf / 'whisper'}\n"
            f"  model.decoder_path: {hf / 'llama'}\n  model.lora_rank: 2")


def errors(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("cluster-fl grid: error")]


def nothing_submitted(grid_path: Path) -> bool:
    grid = load_grid(grid_path)
    return not (grid.root / ".grid" / "jobs.json").exists()


def test_the_paper_grid_as_shipped_is_refused_naming_each_placeholder(tmp_path, capsys):
    path = tmp_path / "paper.yaml"
    path.write_text((REPO / "configs/grids/paper.yaml").read_text()
                    .replace("../arch/", str(REPO / "configs/arch") + "/")
                    .replace("../method/", str(REPO / "configs/method") + "/"))
    assert main(["grid", str(path), "--dry-run", "--out", str(tmp_path / "r")]) == 2
    lines = errors(capsys)
    corpus = [ln for ln in lines if ": data.corpus: " in ln]
    assert len(corpus) == 13 * 3  # one per cell (39 cells), not one per seed
    assert "'/path/to/mls' is a placeholder" in corpus[0]
    assert any("whisper-tinyllama__frozen__fedavg: model.encoder_path: model.arch "
               "whisper-tinyllama needs a local checkpoint folder" in ln for ln in lines)
    assert "would submit" not in capsys.readouterr().out


def test_a_placeholder_corpus_is_one_line_and_exit_2_with_nothing_submitted(tmp_path, capsys):
    path = write_grid(tmp_path, "/path/to/mls_parquet")
    assert main(["grid", str(path), "--cluster", "debug"]) == 2
    assert errors(capsys) == [
        f"cluster-fl grid: error: {cell}: data.corpus: '/path/to/mls_parquet' is a placeholder; "
        "fill in a local path" for cell in ("flat", "alpha-split")]
    assert nothing_submitted(path)


def test_a_corpus_without_a_language_names_the_split(tmp_path, tiny_corpus, capsys):
    path = write_grid(tmp_path, tiny_corpus, extra_set="  data.languages: [en, pl]\n")
    assert main(["grid", str(path), "--dry-run"]) == 2
    [line, _] = errors(capsys)
    assert "flat: data.languages: the corpus at" in line
    assert "no pl in split 'private'; no pl in split 'test'" in line


def test_a_missing_checkpoint_file_is_one_line_naming_the_folder(tmp_path, tiny_corpus, hf,
                                                                  capsys):
    import shutil

    broken = tmp_path / "whisper-no-weights"
    shutil.copytree(hf / "whisper", broken)
    (broken / "model.safetensors").unlink()
    path = write_grid(tmp_path, tiny_corpus, arch_set=real_arch(hf, str(broken)))
    assert main(["grid", str(path), "--cluster", "local"]) == 2
    lines = errors(capsys)
    assert lines == [f"cluster-fl grid: error: {cell}: model.encoder_path: {broken} has no "
                     "model.safetensors (or index)" for cell in ("flat", "alpha-split")]
    assert nothing_submitted(path)


def test_a_checkpoint_whose_weights_contradict_its_config_is_refused(tmp_path, tiny_corpus, hf,
                                                                     capsys):
    """config.json says 128 mel bins, the weights were trained on 80."""
    import shutil

    odd = tmp_path / "whisper-128"
    shutil.copytree(hf / "whisper", odd)
    config = json.loads((odd / "config.json").read_text())
    config["num_mel_bins"] = 128
    (odd / "config.json").write_text(json.dumps(config))
    path = write_grid(tmp_path, tiny_corpus, arch_set=real_arch(hf, str(odd)))
    assert main(["grid", str(path), "--dry-run"]) == 2
    [line, _] = errors(capsys)
    assert line.startswith("cluster-fl grid: error: flat: model.encoder_path: "
                           "encoder.conv1.weight: the checkpoint holds shape [64, 80, 3]")
    assert "[64, 128, 3]" in line


def test_features_of_80_mel_bins_for_a_128_bin_encoder_are_refused(tmp_path, tiny_corpus, hf,
                                                                   capsys):
    path = write_grid(tmp_path, tiny_corpus, arch_set=real_arch(hf),
                      extra_set="  data.n_mels: 128\n")
    assert main(["grid", str(path), "--dry-run"]) == 2
    lines = errors(capsys)
    assert len(lines) == 2 and all(": data.n_mels: got 128, but model.arch whisper-tinyllama "
                                   "takes 80 mel bins" in ln for ln in lines)


def test_a_real_architecture_without_checkpoints_needs_init_random_on_purpose(tmp_path,
                                                                              tiny_corpus, capsys):
    path = write_grid(tmp_path, tiny_corpus, arch_set="model.arch: whisper-tinyllama")
    assert main(["grid", str(path), "--dry-run"]) == 2
    keys = [ln.split(": ")[3] for ln in errors(capsys)]
    assert keys == ["model.encoder_path", "model.decoder_path"] * 2
    path = write_grid(tmp_path, tiny_corpus,
                      arch_set="model.arch: whisper-tinyllama\n  model.init: random")
    assert main(["grid", str(path), "--dry-run"]) == 0


def test_a_good_real_grid_passes_and_the_dry_run_prints_resources_and_estimates(
        tmp_path, tiny_corpus, hf, capsys):
    path = write_grid(tmp_path, tiny_corpus, arch_set=real_arch(hf), seeds=(0,),
                      resources="cpus_per_task: 2, mem_gb: 4")
    assert main(["grid", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would submit") == 2
    assert "  resources: 1 node(s) x 1 task(s), 0 GPU(s) and 2 CPU(s) per task, 4 GB, 10 min" in out
    # the session's corpus: other tests may have computed its features already
    assert re.search(r"^  features: (\d+ part\(s\) missing|complete) \(", out, re.M)
    estimate = [ln for ln in out.splitlines() if ln.startswith("  estimate: ")]
    assert len(estimate) == 2 and "GiB per rank (host) at G=1" in estimate[0]
    assert "round ~" in estimate[0] and "utterance-steps" in estimate[0]


def test_every_invalid_cell_is_reported_not_only_the_first(tmp_path, tiny_corpus):
    path = write_grid(tmp_path, tiny_corpus)
    path.write_text(path.read_text().replace("alpha-split.yaml}", "alpha-split.yaml, "
                                             "set: {privacy.alpha: 2.0}}"))
    specs, problems = pf.expand_cells(load_grid(path))
    assert [(p.cell, p.key) for p in problems] == [("alpha-split", "privacy.alpha")]
    assert [s.cell for s in specs] == ["flat", "flat"]


def test_local_and_debug_never_ask_slurm(tmp_path, tiny_corpus, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")  # no sinfo, no sbatch
    path = write_grid(tmp_path, tiny_corpus)
    for cluster in ("local", "debug"):
        assert main(["grid", str(path), "--cluster", cluster, "--dry-run"]) == 0


def test_no_slurm_client_is_one_line(tmp_path, tiny_corpus, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    path = write_grid(tmp_path, tiny_corpus)
    assert main(["grid", str(path), "--cluster", "slurm", "--dry-run"]) == 2
    assert errors(capsys) == ["cluster-fl grid: error: grid: --cluster slurm: sinfo is not on "
                              "PATH (no SLURM client on this machine)"]


def test_slurm_down_is_one_line_and_exit_2(tmp_path, tiny_corpus, monkeypatch, capsys):
    slurm_fakes.install(tmp_path / "bin", monkeypatch, sinfo_error=slurm_fakes.DOWN)
    path = write_grid(tmp_path, tiny_corpus)
    assert main(["grid", str(path), "--cluster", "slurm"]) == 2
    assert errors(capsys) == [f"cluster-fl grid: error: grid: --cluster slurm: SLURM does not "
                              f"answer: {slurm_fakes.DOWN}"]
    assert nothing_submitted(path)


def test_an_unknown_partition_is_one_line_naming_the_ones_there(tmp_path, tiny_corpus,
                                                                 monkeypatch, capsys):
    slurm_fakes.install(tmp_path / "bin", monkeypatch, partitions="debug* cpu")
    path = write_grid(tmp_path, tiny_corpus, resources="partition: gpu")
    assert main(["grid", str(path), "--cluster", "slurm", "--dry-run"]) == 2
    assert errors(capsys) == ["cluster-fl grid: error: grid: resources.partition: no partition "
                              "'gpu' (sinfo lists debug*, cpu)"]


def test_a_gpu_request_no_node_has_is_refused(tmp_path, tiny_corpus, monkeypatch, capsys):
    slurm_fakes.install(tmp_path / "bin", monkeypatch, partitions="debug*", gpus=0)
    path = write_grid(tmp_path, tiny_corpus, resources="gpus_per_task: 1")
    assert main(["grid", str(path), "--cluster", "slurm", "--dry-run"]) == 2
    [line] = errors(capsys)
    assert line.startswith("cluster-fl grid: error: grid: resources.gpus_per_task=1: asks for 1 "
                           "GPUs per node")
    assert line.endswith("no node can ever run it")


def test_an_account_sbatch_refuses_is_named(tmp_path, tiny_corpus, monkeypatch, capsys):
    refusal = ("sbatch: error: Batch job submission failed: Invalid account or "
               "account/partition combination specified")
    slurm_fakes.install(tmp_path / "bin", monkeypatch, test_only_error=refusal)
    path = write_grid(tmp_path, tiny_corpus, resources="account: nobody")
    assert main(["grid", str(path), "--cluster", "slurm", "--dry-run"]) == 2
    assert errors(capsys) == [f"cluster-fl grid: error: grid: resources.account: sbatch "
                              f"--test-only refuses the request: {refusal}"]


def test_a_failed_submission_is_one_line_never_a_traceback(tmp_path, tiny_corpus, monkeypatch,
                                                           capsys):
    refusal = "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy"
    slurm_fakes.install(tmp_path / "bin", monkeypatch, submit_error=refusal)
    path = write_grid(tmp_path, tiny_corpus)
    assert main(["grid", str(path), "--cluster", "slurm"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # the features job goes first while the store lacks a part (the session's corpus may have
    # been featurised by an earlier test): whichever sbatch refuses, one line
    last = err.strip().splitlines()[-1]
    assert last in (f"cluster-fl grid: error: --cluster slurm: the {what}submission failed: "
                    f"{refusal}" for what in ("", "features job's ")), last
    assert nothing_submitted(path)


def test_a_slurm_grid_that_passes_is_submitted(tmp_path, tiny_corpus, monkeypatch, capsys):
    slurm_fakes.install(tmp_path / "bin", monkeypatch)
    path = write_grid(tmp_path, tiny_corpus, seeds=(0,))
    assert main(["grid", str(path), "--cluster", "slurm", "--dry-run"]) == 0
    assert "dry run: 2 of 2 runs would be submitted to slurm" in capsys.readouterr().out

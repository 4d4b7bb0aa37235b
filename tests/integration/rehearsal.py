"""The cluster rehearsal, shared by its two tests: the path a user types --
pre-flight (``grid --dry-run``), the training jobs (``grid --wait``), ``status``, ``table`` --
each a fresh ``cluster-fl`` process, on

* a small corpus in the OpenSLR layout of real MLS (``mls_<language>/{train,dev,test}``, FLAC),
  with paper.yaml's real split names (clients from ``train``, WER on ``test``); on SLURM the
  features array job runs first and the training jobs wait for it (``afterok``);
* Hugging Face folders written by ``save_pretrained`` at real widths with the depth cut to one
  layer a side: whisper-large-v3's encoder (1280 wide, 128 mel bins; its decoder in the file,
  never read) and TinyLlama-1.1B's decoder (2048 wide, GQA 32/4, vocabulary 32000), bf16 files
  trained in fp32 (a bf16 backward on a CPU without fast bf16 units is pathologically slow);
* a grid derived from ``configs/grids/paper.yaml``: its shared settings, shrunk to one round of
  one step, 2 cells (flat, alpha-split on the unfrozen whisper-tinyllama) x 2 seeds, and
  resources a one-node CPU cluster can give.

``tests/integration/test_rehearsal.py`` runs it on local processes (``slow``),
``tests/slurm/test_slurm_rehearsal.py`` on the one-node SLURM of ``.ci/run`` (``slurm``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
PAPER = REPO / "configs" / "grids" / "paper.yaml"
CELLS = ("whisper-tinyllama__unfrozen__flat", "whisper-tinyllama__unfrozen__alpha-split")


def cli(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    """``cluster-fl ARGS`` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "cluster_fl", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def prepare_corpus(root: Path) -> Path:
    """The corpus the rehearsal trains on: OpenSLR folders for English, German and French,
    two training speakers each (the clients), one dev and one test speaker."""
    sys.path.insert(0, str(REPO / "tests"))
    from mls_layouts import write_openslr

    for n, language in enumerate(("english", "german", "french")):
        write_openslr(root, language, {"train": {f"{10 + 2 * n}": 3, f"{11 + 2 * n}": 3},
                                       "dev": {f"{30 + n}": 2}, "test": {f"{40 + n}": 2}})
    return root


def write_checkpoints(root: Path) -> tuple[Path, Path]:
    """Real-width, one-layer Whisper and TinyLlama folders (bf16 files) with a tokenizer."""
    sys.path.insert(0, str(REPO / "tests" / "models"))
    from hf_checkpoints import save_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, WhisperConfig, WhisperModel

    torch.manual_seed(0)
    whisper, llama = root / "whisper-large-v3-1l", root / "tinyllama-1l"
    WhisperModel(WhisperConfig(
        d_model=1280, encoder_layers=1, encoder_attention_heads=20, encoder_ffn_dim=5120,
        decoder_layers=1, decoder_attention_heads=20, decoder_ffn_dim=5120, num_mel_bins=128,
        max_source_positions=1500, vocab_size=51866, pad_token_id=50256, bos_token_id=50257,
        eos_token_id=50257, decoder_start_token_id=50258)
    ).to(torch.bfloat16).save_pretrained(whisper)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=2048, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048)
    ).to(torch.bfloat16).save_pretrained(llama)
    save_tokenizer(llama)
    return whisper, llama


def write_grid(tmp: Path, corpus: Path, whisper: Path, llama: Path, experiment: str) -> Path:
    """paper.yaml's grid, shrunk (module docstring)."""
    raw = yaml.safe_load(PAPER.read_text())
    raw["experiment"], raw["out"] = experiment, str(tmp / "results")
    raw["set"].update({
        "data.corpus": str(corpus), "data.languages": ["en", "de", "fr"],
        "fl.rounds": 1, "fl.clients_per_round": 2, "fl.sampling": "fixed", "fl.local_epochs": 1,
        "fl.max_local_steps": 1, "fl.batch_size": 2, "privacy.noise_multiplier": 0.5,
        "eval.max_utterances": 4, "eval.bootstrap": 10, "eval.max_new_tokens": 4,
        "run.device": "cpu", "run.threads": 1, "run.checkpoint_every": 1})
    arch = raw["axes"]["arch"][0]  # whisper-tinyllama
    arch["preset"] = str((PAPER.parent / arch["preset"]).resolve())
    arch["set"] = {"model.encoder_path": str(whisper), "model.decoder_path": str(llama),
                   "model.lora_rank": 2, "model.dtype": "float32", "model.compile": False}
    raw["axes"] = {
        "arch": [arch],
        "condition": [c for c in raw["axes"]["condition"] if c["name"] == "unfrozen"],
        "method": [dict(m, preset=str((PAPER.parent / m["preset"]).resolve()))
                   for m in raw["axes"]["method"] if m["name"] in ("flat", "alpha-split")]}
    raw["exclude"] = []
    raw["seeds"] = [0, 1]
    raw["resources"] = {"nodes": 1, "tasks_per_node": 1, "gpus_per_task": 0, "cpus_per_task": 1,
                        "mem_gb": 4, "time_min": 30, "array_parallelism": 2,
                        "signal_delay_s": 60}
    raw["features"] = {"tasks": 1, "cpus_per_task": 1, "mem_gb": 2, "time_min": 30}
    path = tmp / f"{experiment}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def rehearse(tmp: Path, cluster: str) -> None:
    """Pre-flight -> (features job on SLURM) -> jobs -> status -> table through the CLI;
    asserts each step's outcome."""
    corpus = prepare_corpus(tmp / "mls")
    whisper, llama = write_checkpoints(tmp / "hf")
    grid = write_grid(tmp, corpus, whisper, llama, f"rehearsal-{cluster}")
    root = tmp / "results" / f"rehearsal-{cluster}"

    dry = cli("grid", grid, "--cluster", cluster, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert dry.stdout.count("would submit") == 4, dry.stdout
    assert dry.stdout.count("  estimate: ") == 4 and "GiB per rank (host) at G=1" in dry.stdout
    assert f"dry run: 4 of 4 runs would be submitted to {cluster}" in dry.stdout

    broken = grid.with_name("broken.yaml")  # the same grid, one checkpoint gone: refused
    broken.write_text(grid.read_text().replace(str(whisper), str(tmp / "hf" / "missing")))
    refused = cli("grid", broken, "--cluster", cluster)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "model.encoder_path:" in refused.stderr and "does not exist" in refused.stderr
    assert "Traceback" not in refused.stderr and not (root / ".grid" / "jobs.json").exists()

    run = cli("grid", grid, "--cluster", cluster, "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"submitted 4 runs to {cluster}" in run.stdout
    if cluster == "slurm":  # the store was empty: its job first, the runs after it
        assert "features: job " in run.stdout and "the runs wait for it" in run.stdout

    state = cli("status", grid)
    assert state.returncode == 0, state.stdout + state.stderr
    for cell in CELLS:
        line = next(ln for ln in state.stdout.splitlines() if ln.startswith(cell))
        assert line.split()[1] == "2", state.stdout  # both seeds done
    table = cli("table", root)
    assert table.returncode == 0, table.stdout + table.stderr
    assert "flat" in table.stdout and "alpha-split" in table.stdout
    for cell in CELLS:
        for seed in (0, 1):
            assert (root / f"{cell}__s{seed}" / "final.parquet").is_file()

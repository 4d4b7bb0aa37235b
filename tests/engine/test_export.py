"""``cluster-fl export RUN OUT``: the decoder's LoRA leaves as a PEFT adapter that
``PeftModel.from_pretrained`` loads onto the exported base with the run's own logits; the encoder
LoRA and connector as safetensors equal to the checkpoint; a model card whose ε, δ, guarantee
and rounds are the run folder's."""

from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import tiny_config

from cluster_fl.cli import main
from cluster_fl.commands import load_checked
from cluster_fl.engine.export import ADAPTER_DIR, trained_model
from cluster_fl.engine.train import run_training


@pytest.fixture(scope="module")
def exported(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    folder = run_training(tiny_config(tiny_corpus, out / "results"))
    assert main(["export", str(folder), str(out / "export")]) == 0
    return folder, out / "export"


def test_peft_loads_the_decoder_adapter_with_the_runs_logits(exported):
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    folder, out = exported
    config = PeftConfig.from_pretrained(str(out / ADAPTER_DIR))
    assert config.peft_type == "LORA" and (out / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert config.base_model_name_or_path == str((out / "base" / "decoder").resolve())
    base = AutoModelForCausalLM.from_pretrained(str(out / "base" / "decoder"))
    peft = PeftModel.from_pretrained(base, str(out / ADAPTER_DIR)).eval()
    ours, _ = trained_model(folder, load_checked(str(folder / "config.yaml"), []))
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.decoder(input_ids=ids).logits
        got = peft(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the adapter matters: without it the logits differ
        plain = AutoModelForCausalLM.from_pretrained(str(out / "base" / "decoder"))(input_ids=ids).logits
    assert not torch.allclose(plain, want, atol=1e-4)


def test_encoder_lora_and_connector_are_the_checkpoints_tensors(exported):
    from safetensors.torch import load_file

    from cluster_fl.engine.checkpoint import load_run_checkpoint

    folder, out = exported
    state = load_run_checkpoint(folder)["state"]
    encoder = load_file(str(out / "encoder-lora.safetensors"))
    connector = load_file(str(out / "connector.safetensors"))
    assert set(encoder) == {k for k in state if k.startswith("encoder.")} and encoder
    assert set(connector) == {k for k in state if k.startswith("connector.")} and connector
    for name, tensor in {**encoder, **connector}.items():
        assert torch.equal(tensor, state[name]), name


def test_the_model_card_reads_its_figures_from_the_run_folder(exported):
    folder, out = exported
    card = (out / "README.md").read_text()
    privacy = json.loads((folder / "privacy.json").read_text())
    assert f"| ε | {privacy['epsilon']:.4g} |" in card
    assert f"| δ | {privacy['delta']} |" in card
    assert f"| guarantee | {privacy['guarantee']}:" in card
    assert f"| neighbouring relation | {privacy['neighbouring_relation']} (one client" in card
    assert "| clipping | alpha-split, C = " in card and "| rounds | 2 |" in card
    assert "after round 2 of 2" in card and "test WER " in card


def test_export_of_a_folder_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is not a run folder (no config.yaml)" in capsys.readouterr().err

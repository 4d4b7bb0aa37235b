"""The dtype policy applied by ``cluster_fl.distributed.parallelize``: checkpoints saved in fp32, fp16 or
bf16 load into ``model.dtype`` for the frozen base, the trainable groups stay fp32 masters, and a
federated round trains from them (the update, clipping and the fixed-point sum stay fp32)."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import save_voxtral, save_whisper_llama

from cluster_fl.config import ModelConfig, load_config
from cluster_fl.distributed.parallelize import Placement, parallelize
from cluster_fl.precision import DTYPES
from cluster_fl.models import build_model, get_trainable, trainable_parameters

SAVED = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: save_whisper_llama(tmp_path_factory.mktemp(name), dtype)
            for name, dtype in SAVED.items()}


def _cfg(root, dtype: str, **kw) -> ModelConfig:
    return ModelConfig(arch="whisper-tinyllama", encoder_path=str(root / "whisper"),
                       decoder_path=str(root / "llama"), lora_rank=2, dtype=dtype, **kw)


def _assert_policy(model, base: torch.dtype) -> None:
    trainable = set(trainable_parameters(model).values())
    assert trainable
    for name, p in model.named_parameters():
        want = torch.float32 if p in trainable else base
        assert p.dtype == want, (name, p.dtype, want)


def _step(model, placement: Placement, batch) -> float:
    params = trainable_parameters(model)
    before = {k: v.detach().clone() for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    loss = placement.backward(model, batch, params)
    opt.step()
    moved = [k for k, v in params.items() if not torch.equal(v.detach(), before[k])]
    assert moved, "no trainable group moved"
    return loss


@pytest.mark.parametrize("saved", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_checkpoint_of_any_dtype_trains_in_the_policy(checkpoints, saved, dtype, batch):
    model = build_model(_cfg(checkpoints[saved], dtype))
    placement = parallelize(model, _cfg(checkpoints[saved], dtype), torch.device("cpu"))
    _assert_policy(model, DTYPES[dtype])
    loss = _step(model, placement, batch)
    assert torch.isfinite(torch.tensor(loss))
    _assert_policy(model, DTYPES[dtype])  # AdamW kept the masters fp32
    assert all(v.dtype == torch.float32 for v in get_trainable(model).values())


def test_voxtral_in_bf16_keeps_fp32_masters(tmp_path, batch):
    save_voxtral(tmp_path / "vox", torch.float16)
    cfg = ModelConfig(arch="voxtral", decoder_path=str(tmp_path / "vox"), lora_rank=2,
                      dtype="bfloat16")
    model = build_model(cfg)
    placement = parallelize(model, cfg, torch.device("cpu"))
    _assert_policy(model, torch.bfloat16)
    assert torch.isfinite(torch.tensor(_step(model, placement, batch)))


def test_activation_checkpointing_gives_the_same_gradients(batch):
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(arch="whisper-tinyllama-tiny", activation_checkpointing=ac)
        model = build_model(cfg)
        placement = parallelize(model, cfg, torch.device("cpu"))
        params = trainable_parameters(model)
        placement.backward(model, batch, params)
        grads.append({k: p.grad.clone() for k, p in params.items()})
        names = [n for n, _ in model.named_parameters()]
        assert not any("checkpoint" in n for n in names)  # group names unchanged
        layers = [*model.encoder.layers, *model.decoder.model.layers]
        assert all(getattr(layer.forward, "activation_checkpointing", False) == ac
                   for layer in layers)
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-7)


def test_a_round_trains_from_a_half_precision_checkpoint(checkpoints, tiny_corpus, tmp_path):
    from cluster_fl.engine.checkpoint import load_run_checkpoint
    from cluster_fl.engine.metrics import read_rows
    from cluster_fl.engine.train import run_training

    root = checkpoints["fp16"]
    cfg = load_config(None, [
        "model.arch=whisper-tinyllama", f"model.encoder_path={root / 'whisper'}",
        f"model.decoder_path={root / 'llama'}", "model.lora_rank=2", "model.dtype=bfloat16",
        "model.activation_checkpointing=true", f"data.corpus={tiny_corpus}",
        "data.languages=[en,de]", f"run.out={tmp_path}", "fl.rounds=1", "fl.clients_per_round=3",
        "fl.max_local_steps=2", "fl.batch_size=4", "eval.max_utterances=2", "eval.bootstrap=5",
        "eval.max_new_tokens=3", "run.threads=1", "privacy.clipping=alpha-split"])
    folder = run_training(cfg)
    from cluster_fl.engine.operator_log import read_operator_log

    row = read_rows(folder / "rounds.parquet")[0]
    cohort = [e["cohort"] for e in read_operator_log(folder) if e["event"] == "round"]
    assert cohort[0] >= 1 and torch.isfinite(torch.tensor(row["loss"]))
    state = load_run_checkpoint(folder)["state"]
    assert state and all(v.dtype == torch.float32 for v in state.values())
    assert (folder / "final.parquet").is_file()


def test_the_runs_precision_is_derived_once_and_a_skeleton_is_allocated_in_it(checkpoints,
                                                                              monkeypatch):
    """``model.dtype``/``model.compile`` are derived once on a run's path
    (``precision.run_precision``) and handed to the build and to ``parallelize``: an eager run
    (``model.compile: false``) on a fast-bf16 CPU runs fp32, and its skeleton is allocated in
    fp32 -- the build's own guess (compiled, so bf16) would read an fp32 checkpoint through bf16
    and cast it back. A sharded lane compiles as an unsharded rank does."""
    import cluster_fl.precision as precision
    from cluster_fl.precision import run_precision

    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.delenv("CLUSTER_FL_COMPILE", raising=False)
    assert run_precision("auto", "auto", "cpu") == (torch.bfloat16, True)
    assert run_precision("auto", False, "cpu") == (torch.float32, False)
    assert run_precision("float16", False, "cpu") == (torch.float16, False)
    cfg = _cfg(checkpoints["fp32"], "auto")
    lane = build_model(cfg, meta=True, storage_dtype=run_precision("auto", False, "cpu")[0])
    guessed = build_model(cfg, meta=True)
    frozen = [n for n, p in lane.named_parameters() if p.is_meta]
    assert frozen
    assert {p.dtype for n, p in lane.named_parameters() if n in frozen} == {torch.float32}
    assert {p.dtype for n, p in guessed.named_parameters() if n in frozen} == {torch.bfloat16}

"""``privacy.diagnostics: off``: the run releases only the update.

The round's metrics row holds no statistic of the clients (no loss, clip rate, norm or count),
the secure sum carries nothing of them beside the update, nothing is noised for diagnostics and
the accountant charges nothing for them; training itself is untouched (the released update is
bitwise the one a run with noised diagnostics releases). A round in which no client contributed
is told to the operator only (:attr:`RoundOutput.operator`), never in the row. ``on`` is the
default ``noised``, so default run ids stay as they were.
"""

from __future__ import annotations

import torch

from engine_helpers import (FAKE_GROUPS, FakeRunner, engine_config, make_engine, random_update,
                            zero_state)

from cluster_fl.engine.rundir import run_id
from cluster_fl.privacy import compute_epsilon, ledger_for
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

CLIENT_STATISTICS = ("loss", "total_norm", "clip_rate", "n_clients", "n_skipped", "n_nonfinite",
                     "diag_noise_std", "clip_rate/", "retained/", "mean_norm/", "norm/")


def _round(*extra):
    cfg = engine_config("fl.clients_per_round=4", "privacy.noise_multiplier=1.0", *extra)
    engine = make_engine(cfg, FakeRunner(random_update), 6)
    return cfg, engine, engine.run_round(1, zero_state())


def test_off_releases_no_client_statistic_and_trains_exactly_as_noised():
    # one run id for both: the noise streams are scoped by it (two configs, two streams)
    _, engine, off = _round("privacy.diagnostics=off", "run.run_id=same")
    _, _, noised = _round("privacy.diagnostics=noised", "run.run_id=same")
    leaked = [k for k in off.row if k.startswith(CLIENT_STATISTICS)]
    assert leaked == [] and off.row["diagnostics"] == "off"
    assert "diag" not in engine.summer.fields and engine.diag.noise_std == 0.0
    assert any(k.startswith("clip_rate/") for k in noised.row)  # the noised run does release them
    assert {k: v for k, v in off.row.items() if k.startswith("threshold/")} == \
        {k: v for k, v in noised.row.items() if k.startswith("threshold/")}
    for g in FAKE_GROUPS:  # the update and its noise do not depend on the diagnostics
        assert torch.equal(off.state[g.name], noised.state[g.name]), g.name


def test_an_empty_round_is_told_to_the_operator_only_with_diagnostics_off():
    def nan(client, round_):
        return {s.name: torch.full(s.shape, float("nan")) for s in FAKE_GROUPS}

    cfg = engine_config("fl.clients_per_round=4", "privacy.diagnostics=off")
    out = make_engine(cfg, FakeRunner(nan), 6).run_round(1, zero_state())
    assert out.operator["trained"] == 4 and out.operator["nonfinite"] == 4
    assert set(out.row) == {"diagnostics", "round", "denominator"} | {
        k for k in out.row if k.startswith("threshold/")}
    _, _, out = _round("privacy.diagnostics=off")
    assert out.operator["trained"] == 4 and out.operator["nonfinite"] == 0


def test_off_is_not_charged_by_the_accountant():
    cfg, _, _ = _round("privacy.diagnostics=off")
    ledger = ledger_for(cfg, 6)
    ledger.step(rounds=10)
    assert ledger.diagnostics_noise_multiplier is None and ledger.guarantee == "simulation"
    update_only = compute_epsilon(1.0, 4 / 6, 10, cfg.privacy.delta, sampling="fixed",
                                  population=6, cohort_size=4)
    assert ledger.epsilon() == update_only
    noised = ledger_for(engine_config("fl.clients_per_round=4", "privacy.noise_multiplier=1.0"), 6)
    noised.step(rounds=10)
    assert noised.epsilon() > update_only


def test_on_and_off_read_from_yaml_and_the_default_run_id_is_unchanged():
    assert resolved_config(None, ["privacy.diagnostics=off"]).privacy.diagnostics == "off"
    on = resolved_config(None, ["privacy.diagnostics=on"])
    assert on.privacy.diagnostics == "noised"
    # the id of the default config, as before privacy.diagnostics learned `off` (with the base
    # dtype of those runs: the default became `auto`, which computes in bf16 on AMX CPUs)
    expected = "whisper-tinyllama-tiny_unfrozen_alpha-split_s0_6c0e30c8"
    fp32 = ["model.dtype=float32", "eval.max_new_tokens=64"]  # and their decoding limit
    assert run_id(resolved_config(None, fp32)) == run_id(resolved_config(None, ["privacy.diagnostics=on",
                                                                        *fp32])) == expected
    assert run_id(resolved_config(None)) == run_id(on)

"""Numbers as users type them, secure mode without a seed, and the missing-language opt-out.

- ``1e-3``, ``1e-5``, ``5E-4`` are numbers in overrides and in YAML presets (YAML 1.1 reads them
  as strings, which the validators then refused as "must be a number");
- ``privacy.secure_mode=true`` refuses a seed given in a preset or an override (one line naming
  ``run.seed``, exit 2); without one the resolved config says ``seed: null`` and round-trips;
  ``run.seed: null`` outside secure mode is refused too (research mode needs a seed);
- a secure run's id says ``ssecure``; research run ids do not move.
"""

from __future__ import annotations

import pytest

from cluster_fl import cli
from cluster_fl.config import (ConfigError, build_config, dump_config, load_config,
                               parse_override, override, yaml_load)
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)


@pytest.mark.parametrize("text,value", [("fl.lr=1e-3", 1e-3), ("privacy.delta=1e-5", 1e-5),
                                        ("fl.lr=5E-4", 5e-4), ("fl.lr=+2e-2", 2e-2),
                                        ("privacy.delta=1.0e-5", 1e-5), ("fl.lr=0.5", 0.5)])
def test_overrides_parse_exponent_numbers_as_floats(text, value):
    key, parsed = parse_override(text)
    assert isinstance(parsed, float) and parsed == value
    cfg = load_config(None, [text])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == value


def test_exponent_numbers_in_a_yaml_preset_are_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("fl:\n  lr: 1e-3\nprivacy:\n  delta: 1e-5\n")
    cfg = load_config(path)
    assert cfg.fl.lr == 1e-3 and cfg.privacy.delta == 1e-5
    # strings and integers keep their YAML meaning
    assert yaml_load("a: e5\nb: 1e\nc: 12\nd: '1e-3'\ne: [en, de]") == {
        "a": "e5", "b": "1e", "c": 12, "d": "1e-3", "e": ["en", "de"]}


def test_a_bad_number_still_names_the_key():
    with pytest.raises(ConfigError, match=r"fl\.lr.*must be a number"):
        load_config(None, ["fl.lr=1e-3x"])


@pytest.mark.parametrize("where", ["override", "preset"])
def test_secure_mode_refuses_an_explicit_seed(where, tmp_path):
    if where == "override":
        args = (None, ["privacy.secure_mode=true", "run.seed=3"])
    else:
        path = tmp_path / "c.yaml"
        path.write_text("privacy:\n  secure_mode: true\nrun:\n  seed: 3\n")
        args = (path, [])
    with pytest.raises(ConfigError) as exc:
        load_config(*args)
    assert exc.value.key == "run.seed" and "secure_mode" in str(exc.value)


def test_secure_mode_refusal_is_one_line_and_exit_2(capsys, tmp_path):
    preset = tmp_path / "c.yaml"
    preset.write_text("fl:\n  rounds: 1\n")
    assert cli.main(["dump-config", str(preset), "privacy.secure_mode=true", "run.seed=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.seed" in err[0] and "secure_mode" in err[0]


def test_secure_mode_without_a_seed_resolves_to_null_and_round_trips(tmp_path):
    cfg = load_config(None, ["privacy.secure_mode=true"])
    assert cfg.run.seed is None
    text = dump_config(cfg)
    assert "seed: null" in text
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_config(path) == cfg
    assert override(cfg, {"fl.rounds": 2}).run.seed is None
    # an inherited seed is explicit too: switching a research config to secure mode needs it gone
    with pytest.raises(ConfigError, match="run.seed"):
        override(load_config(None, []), {"privacy.secure_mode": True})
    assert override(load_config(None, []), {"privacy.secure_mode": True, "run.seed": None}) == cfg


def test_a_null_seed_outside_secure_mode_is_refused():
    with pytest.raises(ConfigError, match="run.seed"):
        load_config(None, ["run.seed=null"])
    with pytest.raises(ConfigError, match="privacy.secure_mode"):
        build_config({"privacy": {"secure_mode": "yes please"}})


def test_secure_run_ids_say_so_and_research_ids_do_not_move():
    from cluster_fl.engine.rundir import run_id

    secure = run_id(resolved_config(None, ["privacy.secure_mode=true"]))
    assert "_ssecure_" in secure
    # pinned (computed before this change): results/ folders and grids rely on ids. Moved once,
    # on 2026-12-05: the default corpus became corpus-v3 and paths enter ids by their last name
    # (with the base dtype of those runs: the default became `auto`, bf16 on AMX CPUs; and
    # with their decoding limit: the default became `auto`, which decodes differently --
    # the study's grids set 96 through demo.yaml, so their ids stand)
    old = ["model.dtype=float32", "eval.max_new_tokens=64"]
    assert run_id(resolved_config(None, old)) == \
        "whisper-tinyllama-tiny_unfrozen_alpha-split_s0_6c0e30c8"
    assert run_id(resolved_config(None, ["privacy.clipping=flat", "fl.lr=1e-3", "privacy.delta=1e-5",
                                         "data.languages=[en,de]", *old])
                  ) == "whisper-tinyllama-tiny_unfrozen_flat_s0_c7b22315"
    assert run_id(resolved_config(None, old[:1])) != run_id(resolved_config(None, old))


def test_missing_language_opt_out_is_a_bookkeeping_key():
    from cluster_fl.engine.rundir import run_id

    base = resolved_config(None, [])
    assert base.data.allow_missing_languages is False
    assert run_id(resolved_config(None, ["data.allow_missing_languages=true"])) == run_id(base)


def test_secure_mode_without_the_masked_secure_sum_is_refused():
    # secure mode promises that no rank sees another's partial sum: that needs the masks
    with pytest.raises(ConfigError, match=r"aggregation\.secure_sum"):
        load_config(None, ["privacy.secure_mode=true", "aggregation.secure_sum=false"])
    assert not load_config(None, ["aggregation.secure_sum=false"]).aggregation.secure_sum
    assert load_config(None, ["privacy.secure_mode=true"]).aggregation.secure_sum

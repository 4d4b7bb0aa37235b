"""Typed config and its command-line errors: an unknown key names the nearest keys, a bad value
names the key and the allowed range, a bad config exits 2 with exactly one stderr line and no
traceback, privacy off is written out, and ``dump-config`` round-trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster_fl import cli
from cluster_fl.config import (SECTIONS, Config, ConfigError, build_config, dump_config,
                               load_config, override, to_dict, valid_keys)
from cluster_fl.models.registry import resolve_shapes
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

LAYOUT = str(Path(__file__).parents[1] / "privacy" / "data" / "layout.yaml")


@pytest.mark.parametrize("key,nearest", [
    ("privacy.clip_nrom", "privacy.clip_norm"),
    ("privacy.noise_multipler", "privacy.noise_multiplier"),
    ("fl.round", "fl.rounds"),
    ("model.freeze_encodr", "model.freeze_encoder"),
])
def test_unknown_override_names_nearest_keys(key, nearest):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"{key}=1"])
    msg = str(exc.value)
    assert key in msg and nearest in msg and "unknown key" in msg


def test_unknown_key_in_yaml_and_unknown_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("privacy:\n  alpah: 0.1\n")
    with pytest.raises(ConfigError, match=r"privacy\.alpah.*privacy\.alpha"):
        load_config(path)
    with pytest.raises(ConfigError, match="unknown key"):
        build_config({"privcy": {}})


@pytest.mark.parametrize("override,key,allowed", [
    ("privacy.alpha=1.5", "privacy.alpha", "(0.0, 1.0)"),
    ("privacy.clip_norm=0", "privacy.clip_norm", "(0.0, inf]"),
    ("privacy.delta=2", "privacy.delta", "(0.0, 1.0)"),
    ("privacy.population=-1", "privacy.population", "[0, inf]"),
    ("privacy.clipping=clipall", "privacy.clipping", "alpha-split"),
    ("privacy.accountant=gdp", "privacy.accountant", "rdp, pld"),
    ("fl.rounds=0", "fl.rounds", "[1, inf]"),
    ("fl.sampling=random", "fl.sampling", "poisson, fixed"),
    ("fl.rounds=2.5", "fl.rounds", "integer"),
    ("privacy.noise_multiplier=.nan", "privacy.noise_multiplier", "finite"),
    ("eval.decode_cache=paged", "eval.decode_cache", "auto, static, dynamic"),
])
def test_bad_value_names_key_and_allowed_range(override, key, allowed):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert exc.value.key == key
    assert key in str(exc.value) and allowed in str(exc.value)


def test_pool_shares_must_sum_to_one():
    with pytest.raises(ConfigError, match="privacy.pools"):
        load_config(None, ["privacy.clipping=pools",
                           "privacy.pools=[{name: a, components: [encoder], share: 0.3},"
                           " {name: b, components: [decoder], share: 0.3}]"])


@pytest.mark.parametrize("argv,key", [
    (["dump-config", LAYOUT, "privacy.alpha=2"], "privacy.alpha"),
    (["dump-config", LAYOUT, "privacy.clip_nrom=1"], "privacy.clip_norm"),
    (["account", LAYOUT, "fl.rounds=-3"], "fl.rounds"),
    (["thresholds", LAYOUT, "privacy.inside_pool=median"], "privacy.inside_pool"),
    (["dump-config", "/no/such/config.yaml"], "CONFIG"),
    (["dump-config", LAYOUT, "privacy.alpha"], "privacy.alpha"),
])
def test_bad_config_exits_2_with_one_line(capsys, argv, key):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and out == ""
    assert "Traceback" not in err


def test_console_bad_config_has_no_traceback(tmp_path):
    # The real process: exit code, stderr and stdout as a user sees them.
    proc = subprocess.run([sys.executable, "-m", "cluster_fl", "dump-config", LAYOUT,
                           "privacy.alpha=-1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "privacy.alpha" in lines[0] and "(0.0, 1.0)" in lines[0]


def test_dump_config_round_trips(capsys, tmp_path):
    assert cli.main(["dump-config", LAYOUT, "privacy.clipping=pools",
                     "privacy.pools=[{name: e, components: [encoder], share: 0.25},"
                     " {name: d, components: [connector, decoder], share: 0.75}]",
                     "data.languages=[en, de]", "run.seed=7"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    again = load_config(path)
    # the resolved config: data.n_mels is the model's, written as a number
    assert again == resolve_shapes(load_config(LAYOUT, ["privacy.clipping=pools",
                                         "privacy.pools=[{name: e, components: [encoder], "
                                         "share: 0.25}, {name: d, components: [connector, "
                                         "decoder], share: 0.75}]", "data.languages=[en, de]",
                                         "run.seed=7"]))
    assert again.data.n_mels == 128  # the layout preset names whisper-tinyllama (large-v3)
    assert dump_config(again) == text
    assert again.run.seed == 7 and again.data.languages == ("en", "de")


def test_defaults_round_trip_and_privacy_off_is_written_out():
    cfg = Config()
    assert build_config(yaml.safe_load(dump_config(cfg))) == cfg
    off = override(cfg, {"privacy.mechanism": "none"})
    assert "mechanism: none" in dump_config(off)
    assert set(to_dict(cfg)) == set(SECTIONS)
    assert "privacy.population" in valid_keys()


def test_cluster_path_keys_are_validated_with_the_key_named():
    from cluster_fl.config import ConfigError, load_config

    cfg = load_config(None, ["model.dtype=bfloat16", "model.shard=fsdp2",
                             "model.shard_group_size=2", "run.wait_timeout_s=600"])
    assert (cfg.model.dtype, cfg.model.shard_group_size, cfg.run.wait_timeout_s) == (
        "bfloat16", 2, 600)
    for bad, key in [("model.dtype=fp8", "model.dtype"), ("model.shard=zero9", "model.shard"),
                     ("model.shard_group_size=2", "model.shard_group_size"),
                     ("run.wait_timeout_s=0", "run.wait_timeout_s")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])


def test_lane_layout_keys_do_not_change_the_run_id():
    from cluster_fl.engine.rundir import run_id

    base = run_id(resolved_config(None, []))
    assert run_id(resolved_config(None, ["model.shard=fsdp2", "model.shard_group_size=4",
                                     "model.activation_checkpointing=true",
                                     "run.wait_timeout_s=99"])) == base
    # decoding's KV cache: the same tokens either way (tests/models/test_decoding.py)
    assert run_id(resolved_config(None, ["eval.decode_cache=dynamic"])) == base
    assert run_id(resolved_config(None, ["model.dtype=bfloat16"])) != base


def test_files_enter_the_run_id_by_their_last_name():
    """The same corpus and checkpoint under another home are the same run: the same id, so the
    same research noise (two demo clones in two homes printed two tables until 2026-12-05)."""
    from cluster_fl.engine.rundir import run_id

    def rid(corpus: str, ckpt: str) -> str:
        return run_id(resolved_config(None, [f"data.corpus={corpus}", f"model.checkpoint={ckpt}"]))

    here = rid("/home/a/.cache/cluster_fl/corpus-v3", "/home/a/ckpt/tiny-1600steps")
    assert rid("/scratch/b/corpus-v3/", "/scratch/b/tiny-1600steps") == here
    assert rid("/home/a/.cache/cluster_fl/corpus-v2", "/home/a/ckpt/tiny-1600steps") != here
    assert rid("/home/a/.cache/cluster_fl/corpus-v3", "/home/a/ckpt/tiny-5600steps") != here

    from cluster_fl.report.round0 import round0_folder  # the starting model's score too

    def r0(home: str) -> str:
        return round0_folder(load_config(None, [f"data.corpus={home}/corpus-v3",
                                                f"model.checkpoint={home}/tiny-1600steps"])).name

    assert r0("/home/a") == r0("/scratch/b")


def test_a_resume_from_another_folder_of_the_same_corpus_is_the_same_run(tmp_path):
    from cluster_fl.engine.rundir import write_config
    from cluster_fl.engine.train import _check_existing
    from cluster_fl.errors import UserError

    from cluster_fl.models.registry import resolve_shapes

    def cfg(corpus: str):  # as run_training passes it: shapes resolved
        return resolve_shapes(load_config(None, [f"data.corpus={corpus}"]))

    write_config(tmp_path, cfg("/home/a/corpus-v3"))
    _check_existing(tmp_path, cfg("/scratch/b/corpus-v3"))  # moved: resumes
    with pytest.raises(UserError, match="different config.*data.corpus"):
        _check_existing(tmp_path, cfg("/home/a/corpus-v2"))

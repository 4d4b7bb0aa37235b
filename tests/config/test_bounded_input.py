"""Config input is bounded: an alias bomb, brackets nested 100,000 deep, a value of
megabytes, a 10,000-digit number, a folder name longer than the file system allows -- each is one
line naming the key or file and exit 2, never a traceback or an expansion of 9^9 items."""

from __future__ import annotations

import pytest

from cluster_fl import cli

# the anchors live inside one value (privacy.pools' components, checked only when a policy is
# built): &f is 9^6 = 531,441 items once expanded
LEVELS = ["&a [" + ", ".join(["x"] * 9) + "]"] + [
    f"&{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(5)]
BOMB = ("privacy:\n  clipping: pools\n  pools: [{name: p, share: 1.0, components: ["
        + ", ".join(LEVELS) + "]}]\n")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("name,text", [
    ("alias bomb", BOMB),
    ("nested brackets", "data:\n  languages: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ("long value", "run:\n  experiment: " + "e" * 10_000 + "\n"),
    ("many digits", "fl:\n  lr: " + "1" * 10_000 + "\n"),
])
def test_an_unbounded_config_file_is_one_line_and_exit_2(name, text, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["dump-config", str(path)]) == 2, name
    assert "config key" in _one_line(capsys)


@pytest.mark.parametrize("override", [
    "run.experiment=" + "e" * 10_000,
    "run.experiment=" + "e" * 300,  # one folder name past NAME_MAX
    "fl.lr=" + "1" * 10_000,
    "data.languages=" + "[" * 100_000 + "]" * 100_000,
])
def test_an_unbounded_override_is_one_line_and_exit_2(override, tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    assert cli.main(["dump-config", str(empty), override]) == 2
    assert "config key" in _one_line(capsys)


def test_a_config_path_too_long_for_the_file_system_is_one_line(capsys):
    assert cli.main(["dump-config", "/tmp/" + "c" * 10_000 + ".yaml"]) == 2
    assert "config key" in _one_line(capsys)

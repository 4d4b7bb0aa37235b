"""The front door: ``cluster-fl --version`` names the installed version; the top-level help
names every command and the workflows in a user's words."""

from __future__ import annotations

import pytest

from cluster_fl.cli import COMMANDS, build_parser, main, version


def test_version_prints_the_packages_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"cluster-fl {version()}" and version()[0].isdigit()


def test_the_top_level_help_lists_every_command_and_the_getting_started_commands(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert "getting started:" in out and "cluster-fl export RUN OUT" in out
    assert "docs/config.md" in out
    assert build_parser().prog == "cluster-fl"

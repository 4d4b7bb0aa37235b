"""The documentation holds to what it promises: the config reference is the schema's (generated,
never edited by hand), the README stays a front door (≤ 300 lines, its test command the one
`.ci/run` runs, every command it names a real one), links between pages resolve, and no page
speaks of how the project was made (work periods, issue numbers): pages keep dates."""

from __future__ import annotations

import re
from pathlib import Path

from cluster_fl.cli import COMMANDS
from cluster_fl.config.reference import config_reference, field_docs, sections

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "results" / "STUDY.md"]
# pages other parts of the project write (privacy, MLS data, the cluster guide): linked from here
PROVIDED_ELSEWHERE = {"docs/privacy.md", "docs/mls.md", "docs/cluster.md"}
HISTORY = re.compile(r"\b(sessions? \d+|issues? #?\d+)", re.IGNORECASE)


def test_the_config_reference_is_generated_from_the_schema():
    text = (REPO / "docs" / "config.md").read_text()
    assert text == config_reference(), (
        "docs/config.md differs from the schema: python -m cluster_fl.config.reference > docs/config.md")


def test_every_config_key_is_documented_in_the_reference():
    text = config_reference()
    for section, cls in sections():
        docs = field_docs(cls)
        for name in cls.__dataclass_fields__:
            assert docs.get(name), f"{section}.{name} has no docstring in config/schema.py"
            assert f"| `{section}.{name}` |" in text


def test_the_reference_sees_a_key_without_a_docstring():
    import dataclasses

    @dataclasses.dataclass
    class Planted:
        documented: int = 1
        """A key."""
        bare: int = 2

    assert field_docs(Planted) == {"documented": "A key."}


def test_the_readme_is_a_front_door_and_its_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    demo, tests = blocks[0], blocks[1]
    assert demo.endswith("pip install -e . && cluster-fl demo")
    assert tests in (REPO / ".ci" / "run").read_text().splitlines()
    for name in re.findall(r"\bcluster-fl ([a-z][a-z-]+)", readme):
        assert name in COMMANDS, name


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (page.parent / target).resolve()
            if not path.exists() and str(path.relative_to(REPO)) not in PROVIDED_ELSEWHERE:
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert broken == []


def _project_files() -> list[Path]:
    """The project's own text: package, tests, configs, launchers, benchmarks, CI, docs, and the
    study's report, log and protocol (not the run folders' recorded configs and logs)."""
    out = [*PAGES, REPO / "results" / "LOG.md", REPO / "results" / "repro" / "PROTOCOL.md",
           REPO / "pyproject.toml", REPO / ".ci" / "run", REPO / "ARCHITECTURE.md"]
    for folder in ("cluster_fl", "tests", "configs", "launch", "bench", "slurm"):
        out += [p for p in (REPO / folder).rglob("*")
                if p.suffix in (".py", ".yaml", ".sh", ".md", ".sbatch") and p.is_file()]
    return [p for p in out if p.exists() and p != Path(__file__).resolve()]


def test_no_file_speaks_of_how_the_project_was_made():
    found = [f"{page.relative_to(REPO)}:{i}: {m.group(0)}"
             for page in _project_files()
             for i, line in enumerate(page.read_text(errors="replace").splitlines(), 1)
             for m in HISTORY.finditer(line)]
    assert found == []
    assert HISTORY.search("as measured in session 12") and HISTORY.search("(issue 27)")

"""Planted bugs the test suite must kill: ``python tests/mutants/run.py``.

Each mutant is one or more exact textual replacements in one source file (:data:`MUTANTS` in
``catalog.py``), applied to a temporary copy of the repository and run against the few tests that
should catch it. A mutant is *killed* when those tests fail (pytest exit 1); it *survives* when
they pass (exit 0). Anything else -- an anchor that is not found exactly once (the source moved
on: the mutant would rot silently), a test id that no longer exists (exit 4/5), a timeout -- is an
*error*. The script prints a table (mutant, file, tests, result, seconds) and exits 1 if any
mutant survived or erred, 0 when every mutant was killed.

Before the mutants, the listed tests run once together on the unmutated copy (``--no-baseline``
skips it): a test that already fails would otherwise "kill" every mutant it is listed for.

Not part of the default ``python -m pytest -q`` (the file names are not ``test_*``); ``.ci/run``
runs it after the default suite. Options: ``--only NAME[,NAME]``, ``--list``, ``--keep`` (leave
the copy), ``--timeout S`` (per mutant, default 300).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from catalog import MUTANTS, Mutant  # noqa: E402

KILLED, SURVIVED, ERROR = "killed", "survived", "ERROR"


def copy_repo(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files (what a clean checkout has), else the tree
    without the virtual environment and caches."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = None
    if files is None:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
            ".venv", ".git", "__pycache__", "*.pyc", ".hypothesis", "_scratch"))
        return
    for f in files:
        src = REPO / f
        if src.is_file():  # a file deleted in the work tree but still tracked is skipped
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def apply(mutant: Mutant, root: Path) -> str:
    """Write the mutated file into ``root``; return the original text (to restore). Raises
    ValueError unless every anchor occurs exactly once."""
    path = root / mutant.file
    original = path.read_text()
    text = original
    for old, new in mutant.replace:
        n = text.count(old)
        if n != 1:
            raise ValueError(f"{mutant.name}: anchor found {n} times in {mutant.file} "
                             f"(must be exactly once): {old!r}")
        text = text.replace(old, new)
    path.write_text(text)
    return original


def pytest_cmd(tests: list[str]) -> list[str]:
    # -m "": the listed ids run even when marked slow (pyproject deselects slow by default);
    # a fixed Hypothesis seed: a property test kills a mutant every run or never, not by luck
    return [sys.executable, "-m", "pytest", "-x", "-q", "-m", "", "-p", "no:cacheprovider",
            "--hypothesis-seed=0", *tests]


def env_for(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the copy's package, also in subprocesses (torchrun workers, `python -m cluster_fl`),
    # ahead of any editable install of the original checkout
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_copy(root: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import cluster_fl; print(cluster_fl.__file__)"],
                         cwd=root, env=env_for(root), capture_output=True, text=True)
    where = Path(out.stdout.strip() or "?").resolve()
    if root.resolve() not in where.parents:
        sys.exit(f"mutants: `import cluster_fl` in the copy resolves to {where}, not the copy "
                 f"{root} (an install shadows it); nothing was tested")


def run_tests(root: Path, tests: list[str], timeout: float) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(pytest_cmd(tests), cwd=root, env=env_for(root),
                              capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -1, f"timed out after {timeout:.0f}s\n{exc.stdout or ''}"
    return rc, time.perf_counter() - t0, out


def verdict(rc: int) -> str:
    return {0: SURVIVED, 1: KILLED}.get(rc, ERROR)


def table(rows: list[tuple[str, str, str, str, float]]) -> str:
    head = ("mutant", "file", "tests", "result", "s")
    cells = [head] + [(m, f, t, r, f"{s:.0f}") for m, f, t, r, s in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    lines = []
    for c in cells:
        lines.append("  ".join(x.ljust(w) for x, w in zip(c[:-1], widths)) + "  " + c[-1].rjust(4))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def short(tests: list[str]) -> str:
    """The first test id, shortened (file name, test name cut at 36), and how many more."""
    path, _, node = tests[0].partition("::")
    first = Path(path).name + (f"::{node[:36]}" if node else "")
    return first + (f" (+{len(tests) - 1})" if len(tests) > 1 else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip running the listed tests on the unmutated copy first")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    args = ap.parse_args(argv)
    if len({m.name for m in MUTANTS}) != len(MUTANTS):
        sys.exit("mutants: two mutants share a name")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.only and len(chosen) != len(set(args.only.split(","))):
        sys.exit(f"mutants: unknown name in --only {args.only!r}")
    if args.list:
        for m in chosen:
            print(f"{m.name:28s} {m.file:36s} {m.why}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="cfl-mutants-"))
    root = tmp / "repo"
    rows: list[tuple[str, str, str, str, float]] = []
    try:
        copy_repo(root)
        check_imports_copy(root)
        # every anchor first: a rotted mutant fails the run before any test time is spent
        for m in chosen:
            (root / m.file).write_text(apply(m, root))
        if not args.no_baseline:
            tests = sorted({t for m in chosen for t in m.tests})
            rc, secs, out = run_tests(root, tests, args.timeout * 3)
            print(f"baseline: {len(tests)} test ids on the unmutated copy, exit {rc}, {secs:.0f}s",
                  flush=True)
            if rc != 0:
                print(out[-6000:])
                print("mutants: the listed tests fail WITHOUT any mutant; fix them first")
                return 1
        for m in chosen:
            original = apply(m, root)
            try:
                rc, secs, out = run_tests(root, list(m.tests), args.timeout)
            finally:
                (root / m.file).write_text(original)
            result = verdict(rc)
            rows.append((m.name, m.file.removeprefix("cluster_fl/"), short(m.tests), result, secs))
            print(f"{m.name}: {result} (exit {rc}, {secs:.0f}s)", flush=True)
            if result != KILLED:
                print("  " + m.why)
                print("\n".join("  | " + line for line in out.strip().splitlines()[-15:]))
    except ValueError as exc:
        print(f"mutants: {exc}")
        return 1
    finally:
        if args.keep:
            print(f"copy kept at {root}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(rows))
    bad = [r for r in rows if r[3] != KILLED]
    total = sum(r[4] for r in rows)
    print(f"\n{len(rows) - len(bad)}/{len(rows)} mutants killed in {total:.0f}s"
          + (f"; NOT killed: {', '.join(r[0] for r in bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The entry point preloads a faster malloc (jemalloc / tcmalloc) when one is installed, and
re-executes itself once so its own process runs on it; ``CLUSTER_FL_MALLOC`` picks or refuses.

The end-to-end tests need a real allocator library on the machine (``.ci/run`` installs
libjemalloc2); they skip where there is none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_fl.errors import UserError
from cluster_fl.malloc import ENV, LIBRARIES, find_malloc, preload_malloc

ROOT = Path(__file__).resolve().parents[2]


def _folders(tmp_path, *names):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(parents=True)
    second.mkdir()
    for folder, name in names:
        (tmp_path / folder / name).write_bytes(b"")
    return (str(first), str(second))


def test_auto_takes_the_first_library_in_preference_order_whatever_the_folder(tmp_path):
    folders = _folders(tmp_path, ("a", LIBRARIES[2]), ("b", LIBRARIES[0]))
    assert find_malloc({}, folders) == str(tmp_path / "b" / LIBRARIES[0])
    assert find_malloc({ENV: "auto"}, folders) == str(tmp_path / "b" / LIBRARIES[0])
    assert find_malloc({}, _folders(tmp_path / "empty")) is None  # none: the system's


def test_system_refuses_and_a_path_must_exist(tmp_path):
    folders = _folders(tmp_path, ("a", LIBRARIES[0]))
    assert find_malloc({ENV: "system"}, folders) is None
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    assert find_malloc({ENV: str(lib)}, folders) == str(lib)
    with pytest.raises(UserError, match=ENV):
        find_malloc({ENV: str(tmp_path / "missing.so")}, folders)


def test_preload_goes_first_and_an_allocator_already_preloaded_is_left_alone(tmp_path):
    folders = _folders(tmp_path, ("a", LIBRARIES[1]))
    lib = str(tmp_path / "a" / LIBRARIES[1])
    env = {"LD_PRELOAD": "/opt/other.so"}
    assert preload_malloc(env, folders) == lib
    assert env["LD_PRELOAD"] == f"{lib}:/opt/other.so"
    assert preload_malloc(env, folders) is None  # the second call (the re-executed process)
    assert env["LD_PRELOAD"] == f"{lib}:/opt/other.so"
    env = {}
    assert preload_malloc(env, folders) == lib and env == {"LD_PRELOAD": lib}
    for own in ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, {ENV: "system"}):
        env = dict(own)
        assert preload_malloc(env, folders) is None and env == own


# ---- end to end: the real entry point re-executes itself onto the library

SCRIPT = """
import sys
from cluster_fl import cli
from cluster_fl.malloc import active_malloc
sys.argv = ["cluster-fl", "dump-config", {config!r}, "run.seed=7"]
code = cli.main()
print("MALLOC", active_malloc(), "CODE", code)
"""


def _run(tmp_path, **env_over):
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT.format(config=str(ROOT / "cluster_fl/assets/demo.yaml")))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV)}
    env.update(env_over)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120)


def _installed() -> str:
    lib = find_malloc({k: v for k, v in os.environ.items() if k != ENV})
    if lib is None:
        pytest.skip("no jemalloc / tcmalloc on this machine (.ci/run installs libjemalloc2)")
    return lib


def test_the_entry_point_runs_its_command_once_on_the_preloaded_allocator(tmp_path):
    lib = _installed()
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("seed: 7") == 1  # the command ran once, in the re-executed image
    assert out.stdout.strip().splitlines()[-1] == f"MALLOC {os.path.basename(lib)} CODE 0"


def test_system_keeps_glibc_and_a_missing_library_is_one_line_and_exit_2(tmp_path):
    _installed()
    out = _run(tmp_path, **{ENV: "system"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "MALLOC system CODE 0"
    out = _run(tmp_path, **{ENV: str(tmp_path / "nope.so")})
    assert "MALLOC system CODE 2" in out.stdout
    assert f"cluster-fl: error: {ENV}=" in out.stderr and "Traceback" not in out.stderr

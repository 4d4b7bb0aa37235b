"""Helpers of the reliability suite: the tiny run, the driver subprocess, and run-folder readers.

The run is the smallest real ``cluster-fl train`` that still checkpoints, resumes and evaluates:
the tiny model on the session's tiny corpus, 3 rounds, a checkpoint after every round. A result
is "identical" when the final trainable state is bit-for-bit equal and every metric row (per
round, final, per utterance) is equal except wall time and the git commit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "driver.py"
ROUNDS = 3
TINY = ["model.arch=whisper-tinyllama-tiny", f"fl.rounds={ROUNDS}", "fl.clients_per_round=4",
        "fl.max_local_steps=2", "fl.batch_size=4", "eval.max_utterances=4", "eval.batch_size=2",
        "eval.bootstrap=10", "eval.max_new_tokens=6", "run.threads=1", "run.checkpoint_every=1",
        "privacy.noise_multiplier=0.5", "privacy.clipping=alpha-split",
        "privacy.inside_pool=ema", "privacy.ema_warmup_rounds=0",
        "aggregation.server_optimizer=momentum"]
# files whose rows may differ between two equal runs
_VOLATILE = {"wall_s", "git_commit"}


def overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [f"data.corpus={corpus}", "data.languages=[en,de,fr]", f"run.out={out}", *TINY,
            *extra]


def config_file(corpus: Path, out: Path, *extra: str) -> Path:
    """The resolved config of the tiny run as a YAML file (what the CLI is given)."""
    from cluster_fl.config import dump_config, load_config

    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.yaml"
    path.write_text(dump_config(load_config(None, overrides(corpus, out, *extra))))
    return path


def folder_of(corpus: Path, out: Path, *extra: str) -> Path:
    from cluster_fl.config import load_config
    from cluster_fl.models.registry import resolve_shapes  # a test stands at the entrance
    from cluster_fl.engine.rundir import run_dir

    return run_dir(resolve_shapes(load_config(None, overrides(corpus, out, *extra))))


def train_in_process(corpus: Path, out: Path, *extra: str) -> Path:
    """``run_training`` in this process (a resumed run, or the reference)."""
    import torch

    from cluster_fl.config import load_config
    from cluster_fl.engine.train import run_training

    torch.set_num_threads(1)
    return run_training(load_config(None, overrides(corpus, out, *extra)))


def result(folder: Path) -> dict[str, Any]:
    """What must be identical between an interrupted-and-resumed run and an uninterrupted one."""
    import pyarrow.parquet as pq

    from cluster_fl.engine.checkpoint import load_run_checkpoint

    def rows(name: str) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in _VOLATILE}
                for r in pq.read_table(folder / name).to_pylist()]

    ckpt = load_run_checkpoint(folder)
    assert ckpt is not None, f"no checkpoint in {folder}"
    final = rows("final.parquet")
    for r in final:  # the resolved config differs in run.out only
        r.pop("config_json", None)
    import json

    ledger = json.loads((folder / "privacy.json").read_text())  # T, ε, rounds started
    privacy = {k: ledger[k] for k in ("rounds", "rounds_started", "epsilon", "guarantee")}
    return {"state": ckpt["state"], "checkpoint_round": ckpt["round"],
            "rounds": rows("rounds.parquet"), "final": final, "eval": rows("eval.parquet"),
            "privacy": privacy}


def assert_identical(folder: Path, reference: dict[str, Any], ignore: tuple[str, ...] = (),
                     rows_ignore: tuple[str, ...] = ()) -> None:
    """``ignore``: final-row columns allowed to differ (``run_id`` when the corpus path does);
    ``rows_ignore``: round-row columns allowed to differ."""
    from cluster_fl.distributed import bitwise_differences

    got = result(folder)
    reference = dict(reference)
    got["final"] = [{k: v for k, v in r.items() if k not in ignore} for r in got["final"]]
    reference["final"] = [{k: v for k, v in r.items() if k not in ignore}
                          for r in reference["final"]]
    for d in (got, reference):
        d["rounds"] = [{k: v for k, v in r.items() if k not in rows_ignore} for r in d["rounds"]]
    assert [r["round"] for r in got["rounds"]] == list(range(1, ROUNDS + 1))  # each row once
    assert bitwise_differences(got["state"], reference["state"]) == []
    for key in ("rounds", "final", "eval", "privacy"):
        assert bitwise_differences(got[key], reference[key]) == [], key
    assert status(folder)["state"] == "done"
    assert temp_files(folder) == []


def status(folder: Path) -> dict[str, Any]:
    import json

    return json.loads((folder / "status.json").read_text())


def temp_files(folder: Path) -> list[str]:
    """Half-written files left in a run folder (``.NAME.tmpPID``)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*tmp*"))


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONWARNINGS="ignore")
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), e.get("PYTHONPATH", "")])
    return e


class Driven:
    """``cluster-fl train`` in its own process group, paused by ``driver.py`` at ``point``."""

    def __init__(self, point: str, config: Path, *extra: str, preexec: Any = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), point, "train", str(config), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
            start_new_session=True, preexec_fn=preexec)
        self.point = point

    def wait_paused(self, timeout: float = 120) -> None:
        """Block until the driver prints that it reached its point."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("AT "):
                assert line.split()[1] == self.point, line
                return
            if not line and self.proc.poll() is not None:
                break
        self.kill()
        raise AssertionError(f"driver never reached {self.point}: rc {self.proc.returncode}\n"
                             + self.proc.stderr.read()[-3000:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (what a scheduler's kill does)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
                self.proc.wait()
        return self.proc.returncode, err


def cli(*args: str, timeout: float = 180, preexec: Any = None) -> subprocess.CompletedProcess:
    """``python -m cluster_fl ARGS`` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "cluster_fl", *args], capture_output=True,
                          text=True, env=env(), timeout=timeout, preexec_fn=preexec)


def one_line_error(stderr: str, command: str = "train") -> str:
    """The CLI's error line; asserts there is exactly one and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [ln for ln in stderr.splitlines() if ln.startswith(f"cluster-fl {command}: error:")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]

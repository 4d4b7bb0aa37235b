"""Smoke test of the peer benchmark driver (bench/peers/run.py) at a tiny size.

The cluster_fl cell always runs through the driver (fresh process, warm-up + timed rounds);
pfl and Flower run only where they are installed (the optional ``bench`` extra), Flower's Ray
start-up only under ``-m slow``. What must hold: every cell reports a positive finite rate, and
the client updates the harness counted equal timed rounds x cohort (a harness that skipped or
double-counted clients, or timed the warm-up round, would fail).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.peers import run  # noqa: E402

ROUNDS, CLIENTS = 2, 3  # 3 of a population of 4: the cohort is a real sample
TINY = ["--rounds", str(ROUNDS), "--reps", "1", "--speakers-per-language", "2",
        "--peer-precision", "auto",
        "--utterances", "4", "--clients", str(CLIENTS), "--batch-size", "2",
        "--local-steps", "1", "--ranks", "1", "--timeout", "300"]


def _missing(*modules: str) -> bool:
    """True (skip) when a peer framework is not installed -- except with ``CFL_REQUIRE_BENCH=1``
    (``.ci/run``, after installing the bench extra): there the test runs and a missing framework
    fails it instead of skipping it silently."""
    if os.environ.get("CFL_REQUIRE_BENCH") == "1":
        return False
    return any(importlib.util.find_spec(m) is None for m in modules)


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("peers")


def _drive(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, list[dict]]:
    rc = run.main(argv)
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])["peers_bench"]
    return rc, "\n".join(out[:-1]), summary["cells"]


def _check(cells: list[dict], framework: str, privacies: list[str]) -> None:
    assert [(c["framework"], c["privacy"]) for c in cells] == [(framework, p) for p in privacies]
    for c in cells:
        assert c["errors"] == [], c["errors"]
        assert c["median_rate"] is not None and math.isfinite(c["median_rate"])
        assert c["median_rate"] > 0
        assert c["updates"] == [ROUNDS * CLIENTS]
        assert c["round_s"] > 0
        assert c["worker_processes"] == [1]  # --ranks 1: one process trained the clients


@pytest.mark.slow  # ~12 s; .ci/run's bench stage runs tests/bench with its slow tests
def test_cluster_fl_cell_counts_every_client_once(work_dir: Path, capsys) -> None:
    rc, text, cells = _drive(["--frameworks", "cluster_fl", "--ks", "1", "--privacy", "dp",
                              "--work", str(work_dir), *TINY], capsys)
    assert rc == 0
    _check(cells, "cluster_fl", ["dp"])
    assert cells[0]["k"] == 1 and cells[0]["procs"] == 1
    assert "cluster_fl  dp" in text


@pytest.mark.skipif(_missing("pfl"), reason="pfl not installed (pip install -e '.[bench]')")
def test_pfl_cell_counts_every_client_once(work_dir: Path, capsys) -> None:
    rc, _, cells = _drive(["--frameworks", "pfl", "--privacy", "dp", "--work", str(work_dir),
                           *TINY], capsys)
    assert rc == 0
    _check(cells, "pfl", ["dp"])


@pytest.mark.slow
@pytest.mark.skipif(_missing("flwr", "ray"), reason="flwr/ray not installed (pip install -e '.[bench]')")
def test_flower_cell_counts_every_client_once(work_dir: Path, capsys) -> None:
    rc, _, cells = _drive(["--frameworks", "flower", "--privacy", "dp", "--work", str(work_dir),
                           *TINY], capsys)
    assert rc == 0
    _check(cells, "flower", ["dp"])


def test_default_matrix_is_the_benchmarks() -> None:
    """The benchmark's matrix; on a CPU each peer in both precisions (its faster one is the peer)."""
    cells = run.cells_for(run.parse_args([]))
    labels = {c.label for c in cells}
    for privacy in ("dp", "fedavg"):
        assert {f"cluster_fl {privacy} 1p K={k}" for k in (1, 4, 16)} <= labels
        assert {f"cluster_fl {privacy} 2p K={k}" for k in (1, 16)} <= labels
        assert {f"{fw} {privacy} {p}p {prec}" for fw in ("pfl", "flower") for p in (1, 2)
                for prec in ("fp32", "bf16")} <= labels
    assert len(cells) == 26
    gpu = run.cells_for(run.parse_args(["--device", "cuda"]))
    assert {c.precision for c in gpu if c.framework != "cluster_fl"} == {"bf16"}
    fp32 = run.cells_for(run.parse_args(["--peer-precision", "auto"]))
    assert {c.precision for c in fp32 if c.framework != "cluster_fl"} == {"fp32"}


def test_a_cells_precision_reaches_the_peers_work() -> None:
    work = run.Work()
    assert run.Cell("pfl", "dp", 1, precision="bf16").work(work).peer_bf16
    assert not run.Cell("pfl", "dp", 1, precision="fp32").work(work).peer_bf16
    assert run.Cell("cluster_fl", "dp", 1, 1).work(work) == work


def test_table_reports_failures_and_ratios() -> None:
    rows = [{"framework": "cluster_fl", "privacy": "dp", "procs": 1, "k": 1, "rates": [2.0],
             "median_rate": 2.0, "updates": [48], "round_s": 12.0, "errors": []},
            {"framework": "cluster_fl", "privacy": "dp", "procs": 1, "k": 16, "rates": [6.0],
             "median_rate": 6.0, "updates": [48], "round_s": 4.0, "errors": []},
            {"framework": "pfl", "privacy": "dp", "procs": 1, "k": None, "rates": [2.5],
             "median_rate": 2.5, "updates": [48], "round_s": 9.6, "errors": [],
             "precision": "fp32"},
            {"framework": "pfl", "privacy": "dp", "procs": 1, "k": None, "rates": [3.0],
             "median_rate": 3.0, "updates": [48], "round_s": 8.0, "errors": [],
             "precision": "bf16"},
            {"framework": "flower", "privacy": "dp", "procs": 2, "k": None, "rates": [],
             "median_rate": None, "updates": [], "round_s": None, "errors": ["boom"]}]
    text = run.table(rows, run.Work(), 1)
    assert "FAILED  boom" in text
    assert "best cluster_fl (1p K=16) / best peer (pfl 1p bf16) = 2.00x" in text
    assert "cluster_fl 1p K=16 / K=1 = 3.00x" in text


def test_work_names_one_device_and_the_peers_precision() -> None:
    """The sync-free step: every framework trains on the same device; the peers' loop computes in
    bf16 under autocast on a GPU unless told otherwise, in fp32 on a CPU."""
    assert not run.Work().peer_bf16
    assert run.Work(device="cuda").peer_bf16 and run.Work(device="cuda:1").peer_bf16
    assert not run.Work(device="cuda", peer_precision="fp32").peer_bf16
    assert run.Work(peer_precision="bf16").peer_bf16
    for bad in ("gpu", "cuda:x", "CUDA"):
        with pytest.raises(ValueError, match="device must be"):
            run.Work(device=bad)
    with pytest.raises(ValueError, match="peer_precision"):
        run.Work(peer_precision="fp16")
    assert run.main(["--device", "gpu", "--reps", "0"]) == 2  # a clear message, no traceback


def test_the_peers_bf16_loop_trains_the_same_work(work_dir: Path) -> None:
    """The peers' bf16 path (frozen base in bf16, autocast) on the CPU: the base is bf16, the
    trainable weights stay fp32, and local training moves them (what a GPU run does on CUDA)."""
    import torch

    from bench.peers.common import build_model, load_clients, local_train, prepare

    work = run.Work(work_dir=str(work_dir), speakers_per_language=2, utterances=4, clients=3,
                    batch_size=2, local_steps=2, peer_precision="bf16")
    prepare(work)
    model, params = build_model(work)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in params.values()} == {torch.float32}
    before = {k: v.detach().clone() for k, v in params.items()}
    client = load_clients(work)[0]
    steps, loss = local_train(work, model, params, client.load(), 1, client.index)
    assert steps == 2 and loss == loss and loss > 0
    assert any(not torch.equal(before[k], v) for k, v in params.items())


@pytest.mark.skipif(_missing("pfl"), reason="pfl not installed (pip install -e '.[bench]')")
def test_a_missing_gpu_fails_every_cell_clearly(work_dir: Path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu runs the peers on it")
    rc, text, cells = _drive(["--frameworks", "cluster_fl,pfl", "--ks", "1", "--privacy", "dp",
                              "--device", "cuda", "--work", str(work_dir), *TINY], capsys)
    assert rc == 1 and "FAILED" in text
    assert [c["median_rate"] for c in cells] == [None, None]
    assert all(c["errors"] and "cuda" in c["errors"][0].lower() for c in cells), cells



@pytest.mark.parametrize("batch,steps,utterances", [(8, 4, 16), (4, 4, 16), (2, 1, 4),
                                                    (8, 7, 16), (3, 5, 7)])
def test_cluster_fl_takes_the_same_local_steps_as_the_peers(batch, steps, utterances,
                                                            monkeypatch):
    """Same work: cluster_fl's cell takes ``local_steps`` steps a client, as the peers' loop does
    (batch 8 of 16 utterances once gave cluster_fl 2 steps against the peers' 4)."""
    from bench.peers.common import Work, client_batches, cluster_config

    from cluster_fl.engine import setup
    from cluster_fl.engine.batched import local_steps

    work = Work(batch_size=batch, local_steps=steps, utterances=utterances)
    fl = cluster_config(work, "dp").fl
    assert local_steps(utterances, fl.batch_size, fl.local_epochs, fl.max_local_steps) == steps
    # the peers' loop cycles passes of ``batch``-sized batches until ``local_steps`` of them
    monkeypatch.setattr(setup, "make_batches",
                        lambda items, size, g: [items[i:i + size]
                                                for i in range(0, len(items), size)])
    assert len(list(client_batches(work, list(range(utterances)), 1, 0))) == steps

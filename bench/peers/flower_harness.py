"""Flower (PyPI ``flwr`` 1.42) on the peer-benchmark work, through its Message API and its
Simulation Runtime (Ray backend, local, no network).

* ClientApp (``@app.train()``): loads the global LoRA + connector arrays from the message into
  the cluster_fl SpeechLLM, runs the local work with a plain PyTorch loop
  (:func:`bench.peers.common.local_train`: AdamW, ``model.loss(batch)`` on ``make_batches``
  batches) and replies with the local arrays and ``num-examples``; the model and the feature
  store are built once per worker process and kept (Flower's idiom for heavy state);
* ServerApp (``@app.main()``): :class:`flwr.serverapp.strategy.FedAvg` (fixed cohort:
  ``fraction_train`` = cohort / population, ``min_train_nodes`` = cohort, no client-side
  evaluation), wrapped for DP in
  :class:`flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping` (the server clips
  each reply's update to ``clip_norm`` and adds Gaussian noise with std
  ``noise_multiplier * clip_norm / cohort`` to the average);
* processes: ``run_simulation`` with ``num_supernodes`` = population; the Ray backend runs
  ClientApps in N actor processes (``client_resources.num_cpus = 1`` on a Ray node of N CPUs):
  1 or 2 client workers, the ServerApp in the driver process; on a GPU (``work.device``) the
  N actors share it (``client_resources.num_gpus`` = 1/N) and exchange arrays on the host.

Round timing comes from the strategy's ``evaluate_fn`` hook, which Flower calls after every
round; replies are counted in ``aggregate_train``. Telemetry is switched off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.peers.common import (ROOT, CellResult, Work, build_model, load_clients, local_train,
                                one_thread, round_durations)

_WORKER: dict[str, Any] = {}  # per-process cache: model, trainable params, clients


def _client_state(work: Work) -> dict:
    if not _WORKER:
        one_thread()
        model, params = build_model(work)
        _WORKER.update(model=model, params=params, clients=load_clients(work))
    return _WORKER


def _simulate(work: Work, privacy: str, procs: int) -> dict:
    """Run the simulation in this process; returns stamps and counted replies."""
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.simulation import run_simulation

    one_thread()
    population = work.speakers_per_language * 2
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        st = _client_state(work)
        client = st["clients"][int(context.node_config["partition-id"])]
        global_arrays = msg.content["arrays"].to_torch_state_dict()
        params = st["params"]
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(global_arrays[name])
        round_ = int(msg.content["config"]["server-round"])
        _, loss = local_train(work, st["model"], params, client.load(), round_, client.index)
        arrays = ArrayRecord({name: p.detach().cpu().clone() for name, p in params.items()})
        metrics = MetricRecord({"num-examples": len(client), "train_loss": loss,
                                "worker-pid": os.getpid()})
        return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    stamps: list[float] = []
    counted: list[int] = []
    pids: set[int] = set()  # the client worker processes that trained

    class CountingFedAvg(FedAvg):
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            ok = [r for r in replies if not r.has_error()]
            counted.append(len(ok))
            pids.update(int(r.content["metrics"]["worker-pid"]) for r in ok)
            return super().aggregate_train(server_round, replies)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        _, params = build_model(work, on_device=False)  # the server aggregates on the host
        initial = ArrayRecord({name: p.detach().clone() for name, p in params.items()})
        strategy: Any = CountingFedAvg(fraction_train=work.clients / population,
                                       fraction_evaluate=0.0, min_train_nodes=work.clients,
                                       min_evaluate_nodes=0, min_available_nodes=population)
        if privacy == "dp":
            strategy = DifferentialPrivacyServerSideFixedClipping(
                strategy, noise_multiplier=work.noise_multiplier, clipping_norm=work.clip_norm,
                num_sampled_clients=work.clients)

        def stopwatch(server_round: int, arrays: ArrayRecord):
            if server_round >= 1:  # 0 is before the first round; 1 ends the warm-up
                stamps.append(time.perf_counter())
            return None

        strategy.start(grid=grid, initial_arrays=initial, num_rounds=work.rounds + 1,
                       evaluate_fn=stopwatch)

    gpus = 0 if work.device == "cpu" else 1
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=population,
                   backend_config={"client_resources": {"num_cpus": 1,
                                                        "num_gpus": gpus / procs},
                                   "init_args": {"num_cpus": procs, "num_gpus": gpus,
                                                 "include_dashboard": False,
                                                 "logging_level": "ERROR",
                                                 "log_to_driver": False}})
    return {"stamps": stamps, "updates": sum(counted[1:]), "rounds_seen": len(counted),
            "worker_processes": len(pids)}


def run_cell(work: Work, privacy: str, procs: int, timeout_s: float = 3600) -> CellResult:
    """Measure Flower with ``procs`` client worker processes (a fresh driver process: Ray)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0",
               RAY_DISABLE_IMPORT_WARNING="1", RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
    p = subprocess.run([sys.executable, "-m", "bench.peers.flower_harness", "--work",
                        work.to_json(), "--privacy", privacy, "--procs", str(procs)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"flower run failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if out["rounds_seen"] != work.rounds + 1 or len(out["stamps"]) != work.rounds + 1:
        raise RuntimeError(f"flower ran {out['rounds_seen']} round(s), expected "
                           f"{work.rounds + 1}:\n{p.stderr[-4000:]}")
    return CellResult("flower", privacy, procs, None, out["updates"],
                      round_durations(out["stamps"]), work.clients,
                      {"worker_processes": out["worker_processes"]})


def main() -> int:
    ap = argparse.ArgumentParser(description="one Flower simulation of the peer benchmark")
    ap.add_argument("--work", required=True)
    ap.add_argument("--privacy", choices=["dp", "fedavg"], required=True)
    ap.add_argument("--procs", type=int, default=1)
    args = ap.parse_args()
    res = _simulate(Work.from_json(args.work), args.privacy, args.procs)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

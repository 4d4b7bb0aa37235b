"""pfl-research (PyPI ``pfl`` 0.6) on the peer-benchmark work, through its own simulation API.

* model: the cluster_fl SpeechLLM wrapped in a ``torch.nn.Module`` with the ``loss``/``metrics``
  methods pfl's :class:`pfl.model.pytorch.PyTorchModel` adapter calls; local optimiser AdamW
  (``local_optimizer_create``), central optimiser SGD(lr=1) on the averaged difference (pfl's
  FedAvg idiom); pfl sees only the parameters that require grad (LoRA + connector);
* data: a :class:`pfl.data.federated_dataset.FederatedDataset` whose ``make_dataset_fn`` loads a
  user's examples through cluster_fl's feature cache and yields ``make_batches`` batches as
  tensors (pfl moves tensors, not strings); users sampled by ``minimize_reuse`` (each user once
  per round when the cohort is the population);
* loop: :class:`pfl.algorithm.FederatedAveraging` with :class:`pfl.aggregate.simulate.SimulatedBackend`;
  DP = :class:`pfl.privacy.CentrallyAppliedPrivacyMechanism` around
  :class:`pfl.privacy.GaussianMechanism` (flat L2 clipping of each user's update, Gaussian noise
  with std ``noise_multiplier * clip_norm`` on the sum), FedAvg = no postprocessor;
* processes: pfl's own multi-worker simulation (no horovod): N copies of this module with
  ``PFL_WORKER_ADDRESSES``/``PFL_WORKER_RANK``, torch.distributed over gloo; each worker trains
  its part of the cohort and pfl all-reduces the statistics.

Differences that do not change the amount of compute: pfl's local learning rate is constant
(cluster_fl uses a cosine schedule over the same 4 steps). On a GPU (``work.device``) pfl's
device is set through ``PFL_PYTORCH_DEVICE`` and the loss runs under the peers' autocast.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.peers.common import (ROOT, CellResult, Work, build_model, client_batches,
                                decode_batch, encode_batch, load_clients, one_thread,
                                peer_autocast, round_durations)


def _worker(work: Work, privacy: str) -> dict:
    """One pfl worker (env already set): run warm-up + ``work.rounds`` central iterations."""
    one_thread()
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops import pytorch_ops
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

    from cluster_fl.engine.setup import make_batches

    torch.set_num_threads(1)
    clients = load_clients(work)
    by_id = {c.client_id: c for c in clients}
    progress = {"round": 1, "trained": 0}

    class SpeechModule(torch.nn.Module):
        """The SpeechLLM with pfl's ``loss(*batch)`` / ``metrics(*batch)`` interface."""

        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner = inner

        def loss(self, features, lengths, codes, langs):
            self.train()
            with peer_autocast(work):
                return self.inner.loss(decode_batch(features, lengths, codes, langs))[0]

        @torch.no_grad()
        def metrics(self, features, lengths, codes, langs):
            self.eval()
            with peer_autocast(work):
                loss, n = self.inner.loss(decode_batch(features, lengths, codes, langs))
            return {"loss": Weighted(float(loss) * n, n)}

    class SpeakerDataset(Dataset):
        """One user: its examples loaded on demand; ``iter`` yields the local steps' batches."""

        def __init__(self, client):
            super().__init__(raw_data=[torch.zeros(len(client))], user_id=client.client_id)
            self.client = client

        def __len__(self) -> int:
            return len(self.client)

        def iter(self, batch_size):  # noqa: A003 -- pfl's name
            if batch_size != work.batch_size:  # pfl's evaluation pass (warm-up round only)
                items = self.client.load()
                yield encode_batch(next(make_batches(items, len(items), torch.Generator())))
                return
            progress["trained"] += 1
            for batch in client_batches(work, self.client.load(), progress["round"],
                                        self.client.index):
                yield encode_batch(batch)

    class Stopwatch(TrainingProcessCallback):
        """End-of-round timestamps and the number of users trained so far."""

        def __init__(self):
            self.stamps: list[float] = []
            self.trained: list[int] = []

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.stamps.append(time.perf_counter())
            self.trained.append(progress["trained"])
            progress["round"] = central_iteration + 2
            return False, Metrics()

    model, _ = build_model(work)
    module = SpeechModule(model)
    trainable = [p for p in module.parameters() if p.requires_grad]
    pfl_model = PyTorchModel(
        model=module,
        local_optimizer_create=lambda params, lr, **kw: torch.optim.AdamW(
            [p for p in params if p.requires_grad], lr=lr, weight_decay=0.0),
        central_optimizer=torch.optim.SGD(trainable, lr=1.0))
    user_ids = [c.client_id for c in clients]
    data = FederatedDataset(lambda uid: SpeakerDataset(by_id[uid]),
                            get_user_sampler("minimize_reuse", user_ids),
                            user_id_to_weight={c.client_id: len(c) for c in clients})
    post = ([CentrallyAppliedPrivacyMechanism(GaussianMechanism(
        clipping_bound=work.clip_norm, relative_noise_stddev=work.noise_multiplier))]
        if privacy == "dp" else [])
    backend = SimulatedBackend(training_data=data, val_data=None, postprocessors=post)
    watch = Stopwatch()
    rounds = work.rounds + 1  # the first is the untimed warm-up
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=rounds + 1,
                                           train_cohort_size=work.clients, val_cohort_size=None),
        backend=backend, model=pfl_model,
        model_train_params=NNTrainHyperParams(local_num_epochs=None,
                                              local_learning_rate=work.lr,
                                              local_batch_size=work.batch_size,
                                              local_num_steps=work.local_steps),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[watch], send_metrics_to_platform=False)
    dist = pytorch_ops.distributed
    return {"rank": dist.global_rank if dist is not None else 0,
            "world_size": dist.world_size if dist is not None else 1,
            "stamps": watch.stamps, "updates": watch.trained[-1] - watch.trained[0],
            "trainable": sum(v.numel() for v in pfl_model.variable_map.values())}


def run_cell(work: Work, privacy: str, procs: int, timeout_s: float = 3600) -> CellResult:
    """Measure pfl with ``procs`` worker processes (fresh processes: pfl reads its worker
    layout from the environment when it is imported)."""
    from cluster_fl.distributed.spawn import free_port

    ports = [free_port() for _ in range(procs)]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs_ = []
    for rank in range(procs):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", PFL_PYTORCH_DEVICE=work.device)
        if procs > 1:
            env.update(PFL_WORKER_ADDRESSES=addresses, PFL_WORKER_RANK=str(rank))
        procs_.append(subprocess.Popen(
            [sys.executable, "-m", "bench.peers.pfl_harness", "--work", work.to_json(),
             "--privacy", privacy], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs_:
        out, err = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            for q in procs_:
                q.kill()
            raise RuntimeError(f"pfl worker failed (exit {p.returncode}):\n{err[-4000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    lead = next(o for o in outs if o["rank"] == 0)
    if lead["world_size"] != procs:
        raise RuntimeError(f"pfl ran with {lead['world_size']} worker(s), asked for {procs}")
    return CellResult("pfl", privacy, procs, None, sum(o["updates"] for o in outs),
                      round_durations(lead["stamps"]), work.clients,
                      {"trainable": lead["trainable"], "worker_processes": len(outs)})


def main() -> int:
    ap = argparse.ArgumentParser(description="one pfl worker of the peer benchmark")
    ap.add_argument("--work", required=True)
    ap.add_argument("--privacy", choices=["dp", "fedavg"], required=True)
    args = ap.parse_args()
    print(json.dumps(_worker(Work.from_json(args.work), args.privacy)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

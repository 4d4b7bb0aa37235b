"""The one piece of federated work every framework in the peer benchmark runs.

Model, data, local work and privacy setting are defined here once and each harness
(cluster_fl_harness, pfl_harness, flower_harness) only wires them into its framework's own API:

* model: the random-init ``whisper-tinyllama-tiny`` speech-LLM with LoRA (rank 4, alpha 8),
  121,536 trainable parameters (LoRA + connector); the frozen base is shared by every client;
* data: a synthetic eSpeak corpus (en + de), one client per private speaker, 16 utterances
  each, read through cluster_fl's feature cache (the same loading path for every framework);
* local work per client: ``local_steps`` AdamW steps on shuffled batches of ``batch_size``
  utterances from :func:`cluster_fl.engine.setup.make_batches`, loss ``model.loss(batch)``;
* a round: ``clients`` clients (fixed cohort: the whole population when sizes match), FedAvg,
  optionally central DP with flat clipping at ``clip_norm`` and Gaussian noise
  ``noise_multiplier * clip_norm`` on the sum;
* the measure: client updates per second = clients trained / wall time of the timed rounds,
  after one warm-up round, setup excluded, one torch thread per process;
* the device (``device``): every framework trains on the CPU or on one CUDA GPU. The peers'
  plain-PyTorch loop runs the frozen base in bf16 under autocast on a GPU (``peer_precision:
  auto``; what a pfl or Flower user would write), in fp32 on a CPU (eager bf16 is slower there:
  bench/step_profile.py); cluster_fl uses its own ``model.dtype: auto``.

Every harness returns :func:`cell_result`, one JSON-able dict per run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = ("en", "de")
PRIVACY = ("dp", "fedavg")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Work:
    """What one benchmark cell does; the defaults are the benchmark's measurement setup."""

    work_dir: str = "/tmp/cluster_fl_peers"
    speakers_per_language: int = 12  # x 2 languages = 24 private speakers = 24 clients
    utterances: int = 16             # per client
    clients: int = 24                # per round
    batch_size: int = 4
    local_steps: int = 4
    lr: float = 1e-3
    clip_norm: float = 0.2
    noise_multiplier: float = 0.1
    rounds: int = 2                  # timed rounds, after one untimed warm-up round
    seed: int = 0
    device: str = "cpu"              # cpu, or cuda / cuda:N: one GPU for every framework
    peer_precision: str = "auto"     # the peers' forward: auto = bf16 on a GPU, fp32 on a CPU

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda"
                or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be cpu, cuda or cuda:N, not {self.device!r}")
        if self.peer_precision not in PRECISIONS:
            raise ValueError(f"peer_precision must be one of {PRECISIONS}, "
                             f"not {self.peer_precision!r}")
        population = self.speakers_per_language * len(LANGUAGES)
        if not 1 <= self.clients <= population:
            raise ValueError(f"clients per round ({self.clients}) must be in 1..{population} "
                             f"(speakers_per_language x {len(LANGUAGES)} languages)")
        if self.rounds < 1 or self.local_steps < 1 or self.batch_size < 1:
            raise ValueError("rounds, local_steps and batch_size must be >= 1")

    @property
    def local_epochs(self) -> int:
        """Passes over a client's ``utterances`` that hold ``local_steps`` batches: cluster_fl
        stops at ``fl.max_local_steps`` within them, as the peers' loop stops cycling (without
        it, batch 8 of 16 utterances gave cluster_fl 2 steps against the peers' 4)."""
        return math.ceil(self.local_steps * self.batch_size / self.utterances)

    @property
    def peer_bf16(self) -> bool:
        """Whether the peers' loop runs the frozen base in bf16 under autocast."""
        return self.peer_precision == "bf16" or (self.peer_precision == "auto"
                                                 and self.device != "cpu")

    def check_device(self) -> None:
        """Fail a cell early and clearly when its GPU is not there."""
        if self.device != "cpu":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(f"device {self.device!r} asked for, but torch sees no CUDA "
                                   f"device (torch {torch.__version__})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Work":
        return cls(**json.loads(text))


# --------------------------------------------------------------------------- data

def corpus(work: Work) -> Path:
    """Render (once) the synthetic corpus: en + de, ``speakers_per_language`` private
    speakers with ``utterances`` utterances each (as bench/engine_bench.py renders it)."""
    from cluster_fl.data import make_corpus

    out = Path(work.work_dir) / f"corpus-{work.speakers_per_language}x{work.utterances}"
    if not (out / ".peers-ready").exists():
        make_corpus(out, languages=list(LANGUAGES), seed=0, public_speakers=2,
                    private_speakers=work.speakers_per_language, test_speakers=1,
                    public_utterances=4, private_utterances=(work.utterances, work.utterances),
                    test_utterances=4, progress=False)
        (out / ".peers-ready").write_text("ok\n")
    return out


def prepare(work: Work) -> None:
    """Corpus and feature cache, so that no measured process renders or featurises."""
    from cluster_fl.data import FeatureStore, load_utterances

    root = corpus(work)
    FeatureStore(root, progress=False).examples(load_utterances(root, splits=["private"]))


def cluster_config(work: Work, privacy: str, clients_per_step: int = 1):
    """The cluster_fl config of this work: DP = flat clipping + Gaussian noise + secure sum;
    FedAvg = no mechanism, plain sum."""
    from cluster_fl.config import load_config, override
    from cluster_fl.models.registry import resolve_shapes  # a benchmark is a run's entrance

    if privacy not in PRIVACY:
        raise ValueError(f"privacy must be one of {PRIVACY}, not {privacy!r}")
    cfg = resolve_shapes(load_config(ROOT / "cluster_fl" / "assets" / "demo.yaml"))
    over: dict[str, Any] = {
        "data.corpus": str(corpus(work)), "data.languages": list(LANGUAGES),
        "fl.clients_per_round": work.clients, "fl.sampling": "fixed",
        "fl.batch_size": work.batch_size, "fl.max_local_steps": work.local_steps,
        "fl.local_epochs": work.local_epochs,
        "fl.lr": work.lr, "fl.clients_per_step": clients_per_step,
        "run.out": str(Path(work.work_dir) / "runs"), "run.threads": 1, "run.seed": work.seed,
        "run.device": work.device,
        "eval.max_utterances": 4, "eval.bootstrap": 10,
        "privacy.clip_norm": work.clip_norm, "privacy.noise_multiplier": work.noise_multiplier,
    }
    if privacy == "dp":
        over.update({"privacy.mechanism": "gaussian", "privacy.clipping": "flat",
                     "aggregation.secure_sum": True})
    else:
        over.update({"privacy.mechanism": "none", "aggregation.secure_sum": False})
    return override(cfg, over)


@dataclass
class Client:
    """One federated client: its index, id and lazily loaded examples (cluster_fl's loader)."""

    index: int
    client_id: str
    examples: Any  # cluster_fl.engine.setup.LazyExamples

    def load(self) -> list:
        return list(self.examples.load())

    def __len__(self) -> int:
        return len(self.examples)


def load_clients(work: Work) -> list[Client]:
    """The population, in cluster_fl's client order (one client per private speaker)."""
    from cluster_fl.engine.setup import load_clients as cf_load

    _, clients, _ = cf_load(cluster_config(work, "fedavg"))
    return [Client(c.index, c.client_id, c.utterances) for c in clients]


def client_batches(work: Work, examples: Sequence[Any], round_: int, client: int
                   ) -> Iterator[dict]:
    """Shuffled padded batches of one client, randomness from (seed, round, client) as in
    cluster_fl's ClientRunner; cycles through epochs until ``local_steps`` batches."""
    from cluster_fl.engine.setup import make_batches
    from cluster_fl.seeding import generator

    g = generator(work.seed, "client-batches", round_, client)
    steps = 0
    while steps < work.local_steps:
        for batch in make_batches(examples, work.batch_size, g):
            if steps >= work.local_steps:
                return
            yield batch
            steps += 1


# --------------------------------------------------------------------------- model

def build_model(work: Work, on_device: bool = True):
    """(model, trainable parameters by group name): random init from the seed, LoRA applied,
    only LoRA and connector weights require grad; on ``work.device`` (``on_device``) with the
    frozen base in bf16 when the peers compute in bf16 (the trainable weights stay fp32)."""
    import torch

    from cluster_fl.config import ModelConfig
    from cluster_fl.models import build_model as cf_build
    from cluster_fl.models import trainable_parameters
    from cluster_fl.seeding import derive_seed

    torch.manual_seed(derive_seed(work.seed, "init"))
    model = cf_build(ModelConfig(arch="whisper-tinyllama-tiny", lora_rank=4, lora_alpha=8.0))
    if on_device:
        work.check_device()
        if work.peer_bf16:
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        model.to(work.device)
    params = trainable_parameters(model)
    return model, params


def peer_autocast(work: Work):
    """The peers' forward context: bf16 autocast on ``work.device`` when they compute in bf16,
    else nothing."""
    import contextlib

    import torch

    if not work.peer_bf16:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(work.device).type, dtype=torch.bfloat16)


def local_train(work: Work, model, params: dict, examples: Sequence[Any], round_: int,
                client: int) -> tuple[int, float]:
    """Plain PyTorch local training (the loop a Flower ClientApp writes itself): AdamW on the
    trainable parameters, ``local_steps`` steps. Returns (steps, mean loss)."""
    import torch

    from cluster_fl.seeding import derive_seed

    torch.manual_seed(derive_seed(work.seed, "client-torch", round_, client))
    opt = torch.optim.AdamW(list(params.values()), lr=work.lr, weight_decay=0.0)
    model.train()
    steps, loss_sum = 0, 0.0
    for batch in client_batches(work, examples, round_, client):
        opt.zero_grad(set_to_none=True)
        with peer_autocast(work):
            loss, _ = model.loss(batch)
        loss.backward()
        opt.step()
        loss_sum += float(loss.detach())
        steps += 1
    return steps, loss_sum / max(1, steps)


# --------------------------------------------------------------------------- batches as tensors

def encode_batch(batch: dict) -> tuple:
    """A make_batches batch as tensors only (for frameworks that move tensors, not strings):
    features, lengths, transcripts as padded code points, language indices."""
    import torch

    texts = batch["texts"]
    width = max(1, max(len(t) for t in texts))
    codes = torch.full((len(texts), width), -1, dtype=torch.int32)
    for i, t in enumerate(texts):
        if t:
            codes[i, :len(t)] = torch.tensor([ord(ch) for ch in t], dtype=torch.int32)
    langs = torch.tensor([LANGUAGES.index(lang) for lang in batch["languages"]],
                         dtype=torch.int32)
    return batch["features"], batch["lengths"], codes, langs


def decode_batch(features, lengths, codes, langs) -> dict:
    """Inverse of :func:`encode_batch`."""
    texts = ["".join(chr(c) for c in row.tolist() if c >= 0) for row in codes]
    return {"features": features.float(), "lengths": lengths.long(), "texts": texts,
            "languages": [LANGUAGES[int(i)] for i in langs]}


# --------------------------------------------------------------------------- results

@dataclass
class CellResult:
    """One measured run of one framework at one setting."""

    framework: str
    privacy: str
    procs: int
    k: int | None            # cluster_fl's clients_per_step; None for the peers
    updates: int             # clients trained in the timed rounds, counted by the harness
    round_s: list[float]     # wall time of each timed round (rank 0's clock)
    cohort: int
    extra: dict = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return float(sum(self.round_s))

    @property
    def rate(self) -> float:
        return self.updates / self.wall_s if self.wall_s > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(wall_s=self.wall_s, rate=self.rate)
        return d


def round_durations(stamps: Sequence[float]) -> list[float]:
    """Durations between consecutive end-of-round timestamps (stamps[0] = end of warm-up)."""
    return [b - a for a, b in zip(stamps, stamps[1:])]


def median_rate(results: Sequence[dict]) -> float:
    rates = [r["rate"] for r in results if math.isfinite(r.get("rate", float("nan")))]
    return statistics.median(rates) if rates else float("nan")


def one_thread() -> None:
    """One torch thread (and one BLAS/OpenMP thread) in this process."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    import torch

    torch.set_num_threads(1)

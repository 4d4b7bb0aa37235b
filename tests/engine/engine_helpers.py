"""Helpers shared by the engine tests: tiny configs, a fake client runner, run-folder readers.

The fake runner (:class:`FakeRunner`) is a test double for ``ClientRunner``: it returns crafted
updates, so the round engine's clip → secure sum → noise → apply path can be checked without a
model. Worker functions for ``cluster_fl.distributed.spawn`` live here because spawned processes must
import them by module name (``tests`` is not a package; ``tests/engine`` is on ``sys.path`` via
pytest's rootdir-relative import, and each worker re-inserts its folder itself).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from cluster_fl.config import Config, load_config  # noqa: E402
from cluster_fl.models.registry import resolve_shapes  # noqa: E402  (tests are a run's entrance)
from cluster_fl.engine.client import ClientUpdate  # noqa: E402
from cluster_fl.engine.round import ClientData, RoundEngine  # noqa: E402
from cluster_fl.engine.server import ServerOptimizer  # noqa: E402
from cluster_fl.groups import GroupSpec  # noqa: E402

# Small groups for RoundEngine tests: two encoder and two decoder groups (alpha-split pools).
FAKE_GROUPS = [GroupSpec("enc.q.A", "encoder", 24, (4, 6)), GroupSpec("enc.q.B", "encoder", 12, (12,)),
               GroupSpec("conn.w", "connector", 16, (16,)), GroupSpec("dec.v.B", "decoder", 20, (20,))]

# A real run on the tiny corpus, as small as still exercises every path: alpha-split with the
# adaptive EMA rule inside the pools (a noised statistic in the secure sum, policy state in the
# checkpoint) and a server optimiser with state (momentum).
TINY_RUN = ["model.arch=whisper-tinyllama-tiny", "fl.rounds=2", "fl.clients_per_round=4",
            "fl.max_local_steps=2", "fl.batch_size=4", "eval.max_utterances=4",
            "eval.batch_size=1",  # four evaluation batches: both ranks of a parity run decode
            "eval.bootstrap=10", "eval.max_new_tokens=6", "run.threads=1",
            "privacy.noise_multiplier=0.5", "privacy.clipping=alpha-split",
            "privacy.inside_pool=ema", "privacy.ema_warmup_rounds=0",
            "aggregation.server_optimizer=momentum"]


def tiny_overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    """Overrides for a real 2-round run on the session's tiny corpus, writing under ``out``."""
    return [f"data.corpus={corpus}", "data.languages=[en,de,fr]", f"run.out={out}",
            *TINY_RUN, *extra]


def tiny_config(corpus: Path, out: Path, *extra: str) -> Config:
    return resolve_shapes(load_config(None, tiny_overrides(corpus, out, *extra)))


def away_from_init(state: Mapping[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """``state`` moved off its init (LoRA B is zero there): every group's gradient is then
    nonzero, so a relative comparison of updates weighs every group."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def rel_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Relative L2 difference ``|a - b| / |a|`` of two updates over all of ``a``'s groups."""
    num = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a)
    den = sum(float(a[k].double().norm() ** 2) for k in a)
    return math.sqrt(num / den)


def cohort_sizes(folder: Path) -> list[int]:
    """The realised cohort size of every round, from the run's operator log (the run folder
    releases none)."""
    from cluster_fl.engine.operator_log import read_operator_log

    return [e["cohort"] for e in read_operator_log(Path(folder)) if e["event"] == "round"]


def read_run(folder: Path) -> dict[str, Any]:
    """Final trainable state (checkpoint) and round rows without ``wall_s`` from a run folder."""
    from cluster_fl.engine.checkpoint import load_run_checkpoint
    from cluster_fl.engine.metrics import read_rows

    ckpt = load_run_checkpoint(folder)
    assert ckpt is not None, f"no checkpoint in {folder}"
    rows = [{k: v for k, v in r.items() if k != "wall_s"}
            for r in read_rows(Path(folder) / "rounds.parquet")]
    return {"state": ckpt["state"], "rows": rows, "round": ckpt["round"], "folder": str(folder)}


# ---------------------------------------------------------------------------- fake runner
class FakeRunner:
    """Stands in for ``ClientRunner``: ``make(client_index, round) -> delta`` crafts each update."""

    def __init__(self, make: Callable[[int, int], Mapping[str, torch.Tensor]]):
        self.make = make
        self.calls: list[tuple[int, int]] = []

    def train(self, client: int, utterances: Sequence[object], global_state: Any,
              round_: int) -> ClientUpdate:
        self.calls.append((client, round_))
        delta = {k: v.clone() for k, v in self.make(client, round_).items()}
        return ClientUpdate(client=client, delta=delta, n_samples=len(utterances), loss=1.0,
                            steps=1)

    def train_cohort(self, clients, global_state: Any, round_: int):
        for client, utterances in clients:
            yield self.train(client, utterances, global_state, round_)


def fake_clients(n: int) -> list[ClientData]:
    return [ClientData(index=i, client_id=f"c{i}", speaker=f"s{i}", language="en",
                       utterances=[0] * (3 + i % 4)) for i in range(n)]


def random_update(client: int, round_: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A deterministic small update per (client, round), float32 like a real Δ."""
    g = torch.Generator().manual_seed(7919 * round_ + client)
    return {s.name: torch.randn(s.shape, generator=g) * scale for s in FAKE_GROUPS}


def zero_state(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    return {s.name: torch.zeros(s.shape, dtype=dtype) for s in FAKE_GROUPS}


def engine_config(*extra: str) -> Config:
    """Config for a fake-runner RoundEngine over ``fake_clients``: fixed cohort, alpha-split."""
    return resolve_shapes(load_config(None, ["fl.sampling=fixed", "privacy.clipping=alpha-split",
                                             "privacy.alpha=0.25", "privacy.clip_norm=1.0", *extra]))


def make_engine(cfg: Config, runner: FakeRunner, n_clients: int, comm: Any = None,
                groups: Sequence[GroupSpec] = FAKE_GROUPS,
                clients: Sequence[ClientData] | None = None) -> RoundEngine:
    """A RoundEngine over fake clients (or ``clients``) with the config's policy and noise."""
    from cluster_fl.distributed import LocalComm
    from cluster_fl.privacy import make_policy, noise_for

    private = cfg.privacy.mechanism == "gaussian"
    policy = make_policy(cfg.privacy, list(groups)) if private else None
    clients = list(clients) if clients is not None else fake_clients(n_clients)
    return RoundEngine(cfg, comm or LocalComm(), runner, list(groups), clients,
                       policy, noise_for(cfg.privacy, cfg.run.seed),
                       ServerOptimizer(cfg.aggregation))


def flat(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    return torch.cat([state[n].reshape(-1).to(torch.float64) for n in names])


# ---------------------------------------------------------------------------- spawn workers
def noise_worker(comm: Any, n_clients: int, sigma: float, rounds: int,
                 clip_norm: float = 1.0) -> dict[str, Any]:
    """Zero updates on every client; returns each round's released mean (rank's view)."""
    cfg = engine_config("privacy.noise_multiplier=" + repr(sigma),
                        f"fl.clients_per_round={n_clients}", f"privacy.clip_norm={clip_norm!r}")
    runner = FakeRunner(lambda c, r: {s.name: torch.zeros(s.shape) for s in BIG_GROUPS})
    engine = make_engine(cfg, runner, n_clients, comm, groups=BIG_GROUPS)
    means = []
    for r in range(1, rounds + 1):
        state = {s.name: torch.zeros(s.shape, dtype=torch.float64) for s in BIG_GROUPS}
        out = engine.run_round(r, state)
        means.append(flat(out.state, [s.name for s in BIG_GROUPS]))
    return {"means": torch.stack(means), "trained": sorted(c for c, _ in runner.calls),
            "denominator": out.row["denominator"]}


def received_worker(comm: Any, n_clients: int, sigma: float) -> dict[str, Any]:
    """One round of random client updates; returns what THIS rank received from the secure-sum
    all-reduce (the decoded totals), and the released mean. With ``sigma`` 0 the totals are
    the clean sum of the clipped updates."""
    from cluster_fl.secure_sum import SecureSummer

    cfg = engine_config(f"privacy.noise_multiplier={sigma!r}", f"fl.clients_per_round={n_clients}",
                        "privacy.clip_norm=0.5", "run.run_id=received")
    engine = make_engine(cfg, FakeRunner(lambda c, r: random_update(c, r, scale=0.2)), n_clients,
                         comm)
    received, partials = [], []
    reduce = SecureSummer.reduce

    def spy(self, *args, **kwargs):
        partials.append(self.partial())  # what this rank knows of its own clients
        received.append({k: v.clone() for k, v in reduce(self, *args, **kwargs).items()})
        return received[-1]

    SecureSummer.reduce = spy
    try:
        out = engine.run_round(1, zero_state())
    finally:
        SecureSummer.reduce = reduce
    return {"received": received, "partials": partials,
            "mean": flat(out.state, [s.name for s in FAKE_GROUPS])}


# Larger groups for the variance test: 2 x 6000 coordinates per round.
BIG_GROUPS = [GroupSpec("enc.big", "encoder", 6000, (6000,)),
              GroupSpec("dec.big", "decoder", 6000, (6000,))]


def training_worker(comm: Any, overrides: list[str]) -> dict[str, Any]:
    """A real ``run_training`` on this rank; rank 0 reads back the run folder."""
    from cluster_fl.engine.train import run_training

    torch.set_num_threads(1)
    folder = run_training(load_config(None, overrides), comm)
    return read_run(folder) if comm.rank == 0 else {"folder": str(folder)}


def chi2_interval(dof: int, false_alarm: float) -> tuple[float, float]:
    """Two-sided interval for (sample variance / true variance) with known mean 0."""
    from scipy.stats import chi2

    return (chi2.ppf(false_alarm / 2, dof) / dof, chi2.isf(false_alarm / 2, dof) / dof)


def norm(t: torch.Tensor) -> float:
    return math.sqrt(float((t.to(torch.float64) ** 2).sum()))


def preempt_rank0_worker(comm: Any, overrides: list[str], stop_after: int) -> dict[str, Any]:
    """Only rank 0 receives SIGUSR2, right after round ``stop_after``; report how each rank ends.

    Models a signal that reaches the ranks at different round boundaries (one rank per node, the
    scheduler's signals are not synchronised): every rank must still stop after the same round.
    """
    import os
    import signal

    from cluster_fl.engine import round as round_mod
    from cluster_fl.engine.train import Preempted, run_training

    torch.set_num_threads(1)
    original = round_mod.RoundEngine.run_round

    def run_round(self, round_, state):
        out = original(self, round_, state)
        if round_ == stop_after and comm.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR2)
        return out

    round_mod.RoundEngine.run_round = run_round
    try:
        run_training(load_config(None, overrides), comm)
        return {"end": "finished"}
    except Preempted as exc:
        from cluster_fl.engine.checkpoint import load_run_checkpoint

        ckpt = load_run_checkpoint(exc.folder)
        return {"end": "preempted", "checkpoint_round": ckpt["round"] if ckpt else None}
    finally:
        round_mod.RoundEngine.run_round = original


def decisions_worker(comm: Any, overrides: list[str]) -> dict[str, Any]:
    """:func:`training_worker` that also records, on each lane leader, every client's clip
    decision and pre-clip norm as ``(round, client) -> (clipped, pool flags, total norm)``."""
    from cluster_fl.engine import round as round_mod

    decisions: dict[tuple[int, int], tuple] = {}
    original = round_mod.RoundEngine.run_round

    def run_round(self, round_, state):
        if not getattr(self, "_spied", False):
            self._spied, last = True, {}
            train, clip_many = self.runner.train, self.policy.clip_many

            def spy_train(client, *args, **kwargs):
                last["client"] = client
                return train(client, *args, **kwargs)

            def spy_clip_many(deltas):
                assert len(deltas) == 1, "decisions_worker follows one client per block"
                results = clip_many(deltas)
                if self.layout.leader:
                    res = results[0]
                    decisions[(self._round, last["client"])] = (
                        res.clipped, tuple(sorted(res.pool_clipped.items())), res.total_norm)
                return results

            self.runner.train, self.policy.clip_many = spy_train, spy_clip_many
        self._round = round_
        return original(self, round_, state)

    round_mod.RoundEngine.run_round = run_round
    try:
        out = training_worker(comm, overrides)
    finally:
        round_mod.RoundEngine.run_round = original
    out["decisions"] = decisions
    return out


def slow_rank_worker(comm: Any, overrides: list[str], sleep_s: float) -> dict[str, Any]:
    """:func:`training_worker` whose rank 1 trains its first client ``sleep_s`` seconds late."""
    import time

    from cluster_fl.engine import client as client_mod

    original = client_mod.ClientRunner.train
    slept = []

    def train(self, *args, **kwargs):
        if comm.rank == 1 and not slept:
            slept.append(True)
            time.sleep(sleep_s)
        return original(self, *args, **kwargs)

    client_mod.ClientRunner.train = train
    try:
        return training_worker(comm, overrides)
    finally:
        client_mod.ClientRunner.train = original


def noise_only_worker(comm: Any, overrides: list[str]) -> dict[str, Any]:
    """:func:`training_worker` with every client's update zeroed before it is clipped: the run
    releases the noise alone (same seed: the same noise as the trained run, round for round)."""
    from cluster_fl.privacy.clipping import ClipPolicy

    original = ClipPolicy.clip_many  # the engine clips a block at a time

    def clip_many(self, updates):
        return original(self, [{k: torch.zeros_like(v) for k, v in u.items()} for u in updates])

    ClipPolicy.clip_many = clip_many
    try:
        return training_worker(comm, overrides)
    finally:
        ClipPolicy.clip_many = original

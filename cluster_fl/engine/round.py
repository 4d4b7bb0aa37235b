"""One federated round, distributed: cohort → local training → clip → noise once → secure sum → apply.

Every rank runs :meth:`RoundEngine.run_round` with the same global state. A rank trains its shard
of the cohort block by block (``fl.clients_per_step`` clients a block, one batched step for them
all), clips each client's update with the run's policy and adds it to a streaming fixed-point sum
(memory does not grow with the cohort). Rank 0 alone draws the Gaussian noise -- for the update,
the adaptive-clipping statistic and the diagnostic vector -- and adds it, encoded in the same
fixed point, to its own contribution; then ONE secure-sum all-reduce hands every rank the noised
totals, which every rank applies identically. No rank receives the clean sum (rank 0, the noise
step, is the trusted aggregator: see :mod:`cluster_fl.secure_sum`). Privacy code never sees
ranks; this file never clips.

What a round releases (its metrics row) is public (round, denominator, thresholds) or noised
(the diagnostics); the exact facts of the round -- the realised cohort size, how many of this
rank's clients trained, had non-finite updates or no usable audio, the wall time -- are handed
back apart (:attr:`RoundOutput.operator`) for the operator log outside the run folder. Secure
mode samples the cohort from a ChaCha20 stream under a key rank 0 draws at start
(:mod:`cluster_fl.privacy.csprng`); research mode from (seed, round), and its noise streams are
scoped by the run's id, so grid cells that share a seed never share noise.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from cluster_fl.config import Config
from cluster_fl.distributed.comm import Comm
from cluster_fl.distributed.parallelize import LaneLayout
from cluster_fl.engine import cohort as cohort_mod
from cluster_fl.engine.client import ClientRunner, ClientUpdate, HeapTrimmer
from cluster_fl.engine.feeder import ClientFeeder
from cluster_fl.engine.recorder import ChannelRecorder
from cluster_fl.engine.rundir import run_dir, run_id
from cluster_fl.engine.server import ServerOptimizer
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy.clipping import ClipPolicy, ClipResult
from cluster_fl.privacy.csprng import new_key, sample_cohort_secure
from cluster_fl.privacy.diagnostics import Diagnostics, Measured
from cluster_fl.privacy.noise import TAIL_STDS, NoiseSource
from cluster_fl.secure_sum import SecureSummer, mask_mode, share_from_rank0

# largest coordinate of an unclipped (non-private) update the fixed-point sum accepts
NONPRIVATE_BOUND = 1e3


@dataclass
class ClientData:
    """One federated client: a speaker's utterances (features + transcripts) and metadata."""

    index: int
    client_id: str
    speaker: str
    language: str
    utterances: Sequence[object]

    @property
    def size(self) -> int:
        return len(self.utterances)

    def load(self) -> Sequence[object]:
        """The client's usable examples (features are loaded lazily, only while it trains)."""
        loader = getattr(self.utterances, "load", None)
        return loader() if loader is not None else self.utterances


@dataclass
class RoundOutput:
    """What a round hands back: the new global state, its metrics row (released: public or
    noised values only) and ``operator``, the round's exact facts for the operator log, never
    for the run folder: ``cohort`` (realised cohort size), ``trained``, ``nonfinite``,
    ``skipped`` (this rank's lane's clients), ``lanes``, ``wall_s`` and its parts: ``t_clients``
    (local steps, clipping, adding), ``t_noise`` and ``t_sum`` (the secure sum's reduce)."""

    state: dict[str, torch.Tensor]
    row: dict[str, Any] = field(default_factory=dict)
    operator: dict[str, Any] = field(default_factory=dict)


class RoundEngine:
    """Runs rounds on one rank. Holds no client data beyond the current client."""

    def __init__(self, cfg: Config, comm: Comm, runner: ClientRunner, groups: Sequence[GroupSpec],
                 clients: Sequence[ClientData], policy: ClipPolicy | None, noise: NoiseSource,
                 server: ServerOptimizer, recorder: ChannelRecorder | None = None,
                 layout: LaneLayout | None = None, device: torch.device | str = "cpu",
                 feeder: ClientFeeder | None = None):
        self.cfg = cfg
        self.comm = comm
        # client lanes: world/G lanes of G ranks; the cohort is sharded over lanes, and a lane's
        # leader alone adds its clients to the secure sum (G = 1: every rank is a lane)
        self.layout = layout or LaneLayout(comm.world_size, 1, comm.rank)
        self.device = torch.device(device)
        self.runner = runner
        self.groups = list(groups)
        self.clients = list(clients)
        # how a block's client features reach the device (None: each client's load(), as is)
        self.feeder = feeder
        self.policy = policy
        self.noise = noise
        self.private = cfg.privacy.mechanism == "gaussian"
        if self.private:  # the encoded update, not only the float one, must have norm <= C
            self.clip_policy.reserve_encoding(cfg.aggregation.fixed_point_bits)
        self.diag = Diagnostics(self.groups, policy, cfg.privacy)
        # research noise streams are scoped by the run's identity (its config, seed included)
        self.noise_scope = run_id(cfg)
        self._local: dict[str, int] = {}  # this round's exact counts on this rank (operator)
        self.summer = self._make_summer()  # streaming fixed-point sum; reset by every reduce
        # secure mode: cohorts from a CSPRNG key rank 0 draws and every rank shares (never kept)
        self._cohort_key = self._shared_key() if cfg.privacy.secure_mode else None
        self.server = server
        self.recorder = recorder
        self.trimmer = HeapTrimmer()  # trims the heap only when the resident set has grown

    @property
    def clip_policy(self) -> ClipPolicy:
        """The clipping policy of a private run (which always has one)."""
        if self.policy is None:
            raise RuntimeError("a non-private run has no clipping policy")
        return self.policy

    def _shared_key(self) -> bytes:
        """A 256-bit key from rank 0's OS CSPRNG, handed to every rank (collective), each rank's
        copy encrypted under its pair key with rank 0 (authenticated by the job secret): a wire
        observer never sees a round's cohort."""
        key = new_key() if self.comm.rank == 0 else None
        shared = key
        if self.comm.world_size > 1:
            shared = share_from_rank0(self.comm, self.summer.pair_keys(self.comm), key,
                                      "cohort key")
        if not isinstance(shared, bytes):
            raise RuntimeError("the cohort key did not reach this rank")
        return shared

    def _make_summer(self) -> SecureSummer:
        """One buffer for the update groups, the adaptive statistic, diagnostics and weights;
        each noised field reserves room for the noise's tail (rank 0 adds it to the sum)."""
        cfg = self.cfg
        c = cfg.privacy.clip_norm if self.private else NONPRIVATE_BOUND
        shapes: dict[str, Any] = {g.name: (g.shape or (g.numel,)) for g in self.groups}
        bounds: dict[str, float] = {g.name: c for g in self.groups}
        stat = self.clip_policy.statistic_size if self.private else 0
        if stat:
            shapes["stat"], bounds["stat"] = stat, self._stat_bound()
        if self.diag.size:  # ``off`` sums nothing: no statistic of the clients leaves the round
            shapes["diag"], bounds["diag"] = self.diag.size, self.diag.bound
        if not self.private:  # FedAvg divides by the realised weight; DP by the public n
            shapes["weight"], bounds["weight"] = 1, 1.0
        stds = self._noise_stds(shapes)
        mode = mask_mode(cfg.aggregation.secure_sum, cfg.privacy.secure_mode)
        return SecureSummer(shapes, frac_bits=cfg.aggregation.fixed_point_bits,
                            max_clients=max(1, len(self.clients)), bounds=bounds, mode=mode,
                            seed=cfg.seed, device=self.device,
                            offset_bounds={n: TAIL_STDS * sd for n, sd in stds.items() if sd > 0},
                            release_counts=not self.private,  # DP: no exact counts on the wire
                            job_secret=self._job_secret())

    def _job_secret(self) -> bytes | None:
        """Secure mode with several ranks: the job's secret (engine/operator_log.py), which
        authenticates the ranks' key exchange; None otherwise (nothing is exchanged)."""
        if not (self.cfg.privacy.secure_mode and self.comm.world_size > 1):
            return None
        from cluster_fl.engine.operator_log import read_job_secret

        return read_job_secret(run_dir(self.cfg))

    def _stat_bound(self) -> float:
        """Largest |entry| of one client's adaptive statistic in the fixed-point sum. The
        non-private variant (``adaptive_private: false``) has no bound (sensitivity inf): its raw
        norms are clamped to ``NONPRIVATE_BOUND`` so the sum stays representable."""
        sens = float(self.clip_policy.statistic_sensitivity)
        return sens if math.isfinite(sens) else NONPRIVATE_BOUND

    @property
    def population(self) -> int:
        return len(self.clients)

    def cohort(self, round_: int) -> tuple[list[int], list[list[int]]]:
        """(whole cohort, this rank's lane's blocks): the cohort is cut into blocks of
        ``fl.clients_per_step`` clients trained together, and blocks, not ranks or clients, are
        balanced over lanes."""
        fl = self.cfg.fl
        if self._cohort_key is not None:  # secure mode: a CSPRNG, not the (drawn) seed
            members = sample_cohort_secure(self._cohort_key, round_, self.population,
                                           fl.clients_per_round, fl.sampling)
        else:
            members = cohort_mod.sample_cohort(self.cfg.seed, round_, self.population,
                                               fl.clients_per_round, fl.sampling)
        sizes = [c.size for c in self.clients]
        blocks = cohort_mod.blocks(members, sizes, fl.clients_per_step, self.layout.lanes)
        return members, cohort_mod.shard_blocks(blocks, sizes, self.layout.lanes)[self.layout.lane]

    def _weight(self, n_samples: int) -> float:
        agg = self.cfg.aggregation
        if agg.weighting == "samples":
            return min(n_samples, agg.weight_cap) / agg.weight_cap
        return 1.0

    def run_round(self, round_: int, state: Mapping[str, torch.Tensor]) -> RoundOutput:
        t0 = time.perf_counter()
        members, mine = self.cohort(round_)
        thresholds = self.clip_policy.thresholds() if self.private else {}
        if self.private:  # the run-folder format has threshold/<pool> next to threshold/<group>
            thresholds.update(self.clip_policy.pool_thresholds())
        summer = self.summer
        stat_size = self.clip_policy.statistic_size if self.private else 0
        self._local = {"trained": 0, "nonfinite": 0, "skipped": 0}
        feed = (self.feeder.blocks(self.clients, mine) if self.feeder is not None else
                ([(index, self.clients[index].load()) for index in block] for block in mine))
        for loaded in feed:
            for index, items in loaded:
                if not items:  # no usable audio (none, or every row corrupt): skipped, counted
                    self._local["skipped"] += 1
                    if self.diag.size:
                        self._add([{"diag": self.diag.skipped()}])
            usable = [(index, items) for index, items in loaded if items]
            if usable:  # a block's updates are clipped and added together (one host read)
                self.contribute(round_, list(self.runner.train_cohort(usable, state, round_)))
                self.trimmer.after_client()
            del loaded, usable
        t_clients = time.perf_counter()
        if self.comm.rank == 0:  # the noise step, BEFORE the sum: no rank gets the clean total
            self._add_noise(round_, summer)
        t_noise = time.perf_counter()
        record = self.recorder is not None
        noised = summer.reduce(self.comm, round_, record=record)
        t_sum = time.perf_counter()
        if self.recorder is not None:
            self.recorder.partial(round_, self.comm.rank, summer)

        denom = cohort_mod.denominator(self.cfg.fl.clients_per_round, self.population,
                                       self.cfg.fl.sampling)
        if not self.private:  # plain FedAvg: average over the clients that contributed
            denom = max(float(noised["weight"].item()), 1e-12)
        mean = {g.name: noised[g.name] / denom for g in self.groups}
        new_state = self.server.step(state, mean)
        if stat_size:
            self.clip_policy.update(noised["stat"], denom)
        if self.recorder is not None:
            std = self.cfg.privacy.sigma * self.cfg.privacy.clip_norm if self.private else 0.0
            self.recorder.release(round_, mean, denom, std)
        row = self.diag.row(noised.get("diag"), thresholds, denom)
        row.update(round=round_, denominator=denom)
        operator = dict(self._local, cohort=len(members), lanes=self.layout.lanes,
                        wall_s=time.perf_counter() - t0, t_clients=t_clients - t0,
                        t_noise=t_noise - t_clients, t_sum=t_sum - t_noise)
        return RoundOutput(state=new_state, row=row, operator=operator)

    def _add(self, contributions: Sequence[Mapping[str, Any]]) -> None:
        """Contributions into this rank's secure sum (a lane's leader speaks for the lane),
        range-checked on the device: a failure is raised by the round's reduce."""
        if self.layout.leader:
            self.summer.add_many(contributions, defer_check=True)

    def contribute(self, round_: int, upds: Sequence[ClientUpdate]) -> None:
        """A block's tail: clip its updates (DP) and add them, their statistics and diagnostics
        to the sum. The block's norms are read back once -- the tail's one host
        synchronisation (tests/engine/test_host_syncs.py) -- its contributions encoded
        together on the device."""
        results: Sequence[ClipResult | Measured] = (
            self.clip_policy.clip_many([u.delta for u in upds]) if self.private
            else self.diag.measure_many([u.delta for u in upds], NONPRIVATE_BOUND))
        contributions = []
        for upd, res in zip(upds, results):
            self._local["trained"] += 1
            self._local["nonfinite"] += int(bool(res.nonfinite))
            w = 0.0 if res.nonfinite else self._weight(upd.n_samples)
            values = {k: (v * w if w != 1.0 else v) for k, v in res.update.items()}
            if isinstance(res, ClipResult) and self.clip_policy.statistic_size:  # DP runs
                b = self._stat_bound()
                values["stat"] = self.clip_policy.statistic(res).to(torch.float64).clamp(-b, b)
            if self.diag.size:
                values["diag"] = self.diag.client_vector(res, upd.loss)
            if not self.private:
                values["weight"] = torch.tensor([w], dtype=torch.float64)
            contributions.append(values)
            if self.recorder is not None and self.layout.leader:
                self.recorder.upload(round_, self.clients[upd.client], res, upd)
        self._add(contributions)

    def _noise_stds(self, fields: Mapping[str, Any]) -> dict[str, float]:
        """Std of the Gaussian noise each summed field gets (0 = released exactly)."""
        p = self.cfg.privacy
        stds = {name: 0.0 for name in fields}
        if self.private:
            for g in self.groups:
                stds[g.name] = p.sigma * p.clip_norm
            if "stat" in fields:
                stds["stat"] = self.clip_policy.statistic_noise_std
        if "diag" in fields:
            stds["diag"] = self.diag.noise_std
        return stds

    def _add_noise(self, round_: int, summer: SecureSummer) -> None:
        """Rank 0: draw the noise of every noised field once and add it, in fixed point, to
        this rank's contribution to the secure sum (research streams scoped by the run id)."""
        noise = {}
        for name, sd in self._noise_stds(summer.fields).items():
            if sd > 0:
                f = summer.fields[name]
                noise[name] = self.noise.gaussian(f.shape, sd, round=round_,
                                                  stream=f"{self.noise_scope}/{name}",
                                                  dtype=torch.float64)
        if noise:
            summer.add_offset(noise)

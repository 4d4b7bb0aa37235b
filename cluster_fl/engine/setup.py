"""Assemble everything a run needs on one rank: data, model, policy, noise, ledger, round engine.

This is the only place where models, data, privacy and the process boundary meet; each of them
stays ignorant of the others.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from cluster_fl.config import Config, require_resolved, to_dict
from cluster_fl.distributed import Comm
from cluster_fl.distributed.parallelize import LaneLayout, Placement, parallelize, resolve_device
from cluster_fl.engine.batched import local_steps
from cluster_fl.engine.client import ClientRunner
from cluster_fl.engine.cohort import sampling_rate
from cluster_fl.engine.evaluation import ShardedEvaluation
from cluster_fl.engine.feeder import ClientFeeder
from cluster_fl.engine.ledger import RunLedger
from cluster_fl.engine.recorder import ChannelRecorder
from cluster_fl.engine.round import ClientData, RoundEngine
from cluster_fl.engine.rundir import run_dir, run_id
from cluster_fl.engine.server import ServerOptimizer
from cluster_fl.errors import UserError
from cluster_fl.groups import GroupSpec
from cluster_fl.malloc import active_malloc
from cluster_fl.models.registry import feature_shape
from cluster_fl.precision import run_precision
from cluster_fl.privacy.clipping import ClipPolicy
from cluster_fl.seeding import derive_seed


def set_threads(cfg: Config, comm: Comm) -> int:
    """torch intra-op threads: ``run.threads``, or this process's CPUs (its affinity mask, not
    the machine's count) shared evenly with the ranks on its host whose masks overlap it.
    Collective when several ranks run (their masks are gathered); returns the number."""
    import socket

    from cluster_fl.distributed.launch import cpu_mask, threads_per_rank

    mine, host = cpu_mask(), socket.gethostname()
    masks = ([(host, sorted(mine))] if comm.world_size == 1 else
             comm.all_gather_object((host, sorted(mine))))
    n = cfg.run.threads or threads_per_rank(mine, [set(m) for h, m in masks if h == host])
    torch.set_num_threads(n)
    return n


class LazyExamples(Sequence):
    """A client's examples, loaded from the feature cache only while the client trains."""

    def __init__(self, store: Any, client: Any):
        self.store, self.client = store, client

    def __len__(self) -> int:
        size = getattr(self.client, "size", None)  # an IndexedClient: from the index
        return len(self.client.utterances) if size is None else size

    def __getitem__(self, i):  # pragma: no cover - the runner asks for load() instead
        return self.load()[i]

    def load(self) -> list:
        return self.store.client(self.client)


LENGTH_BIN = 16  # mel frames (0.16 s): utterances whose lengths share a bin may share a batch


def make_batches(examples: Sequence[Any], batch_size: int, g: torch.Generator) -> Iterator[dict]:
    """One shuffled pass over a client's examples as padded batches of similar lengths.

    The examples are shuffled, then stably ordered by length bin (``LENGTH_BIN`` frames) and cut
    into batches, which are shuffled in turn: a batch pads to about its own utterances' length
    instead of to the longest of a random draw (on the study's clients that padding was ~20% of
    the encoder's work), while the shuffle still varies which utterances of a bin share a batch
    and the order of the batches. The number of batches is the unsorted pass's.

    ``examples`` packed (:class:`~cluster_fl.data.packed.PackedExamples`, what the run's
    :class:`~cluster_fl.engine.feeder.ClientFeeder` hands over) are padded where they live, a
    GPU included; a list of examples is packed on the host first. Either way the batch is
    :func:`~cluster_fl.data.pad_examples`' bit for bit, its lengths on the host."""
    from cluster_fl.data.packed import PackedExamples, pack_examples

    items: PackedExamples
    if isinstance(examples, PackedExamples):
        items = examples
    else:
        listed = examples.load() if isinstance(examples, LazyExamples) else list(examples)
        if not listed:
            return
        items = pack_examples(listed)
    # the generator is the host's: .numpy() reads its draws without a device in between
    order = torch.randperm(len(items), generator=g).numpy().tolist()
    order.sort(key=lambda i: items.lengths[i] // LENGTH_BIN)
    chunks = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    for c in torch.randperm(len(chunks), generator=g).numpy().tolist():
        yield items.batch(chunks[c])


class Stateful(Protocol):
    """A component whose state a checkpoint carries."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# the stateful components of a run, by their key in the checkpoint; a checkpoint restores the
# first two, while the ledger resumes from its write-ahead record (privacy.json), which
# RunLedger.resume checks against the ledger state the checkpoint carries
CHECKPOINTED = ("server", "policy", "ledger")
RESTORED = ("server", "policy")


@dataclass
class World:
    """Everything built for a run on this rank."""

    cfg: Config
    model: nn.Module
    groups: list[GroupSpec]
    initial_state: dict[str, torch.Tensor]
    policy: ClipPolicy | None  # None for a non-private run
    ledger: RunLedger
    server: ServerOptimizer
    engine: RoundEngine
    evaluation: ShardedEvaluation
    population: int
    placement: Placement
    comm: Comm

    def state_dicts(self) -> dict[str, dict[str, Any]]:
        """Every stateful component's state, by its checkpoint key (no policy: {})."""
        parts: dict[str, Stateful | None] = {k: getattr(self, k) for k in CHECKPOINTED}
        return {k: (obj.state_dict() if obj is not None else {}) for k, obj in parts.items()}

    def load_state_dicts(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore what a checkpoint restores (:data:`RESTORED`), one loop for all."""
        for key in RESTORED:
            obj: Stateful | None = getattr(self, key)
            if obj is not None:
                obj.load_state_dict(checkpoint[key])

    def groups_json(self) -> list[dict]:
        if self.policy is not None:
            return self.policy.group_table()
        return [{"name": g.name, "component": g.component, "numel": g.numel, "pool": "all",
                 "threshold": None} for g in self.groups]

    def evaluate(self, state: dict) -> tuple[dict | None, list[dict] | None]:
        """Collective (every rank calls it): the model at ``state`` decodes the evaluation set,
        sharded over lanes. Rank 0 gets (summary, rows); other ranks (None, None)."""
        from cluster_fl.models import set_trainable

        set_trainable(self.model, state)
        return self.evaluation.run(self.model, self.placement, self.comm)

    def final_row(self, summary: dict, wall_s: float, commit: str) -> dict:
        cfg = self.cfg
        p = cfg.privacy
        row = {"run_id": run_id(cfg), "experiment": cfg.run.experiment, "arch": cfg.model.arch,
               "freeze_encoder": cfg.model.freeze_encoder,
               "method": "none" if p.mechanism == "none" else p.clipping,
               "alpha": p.alpha, "seed": cfg.seed,
               "noise_multiplier": p.noise_multiplier if p.mechanism != "none" else 0.0,
               "clip_norm": p.clip_norm, "epsilon": self.ledger.epsilon(), "delta": p.delta,
               "guarantee": self.ledger.to_json().get("guarantee"),
               "rounds": cfg.fl.rounds, "population": self.population, "wall_s": wall_s,
               "git_commit": commit, "config_json": json.dumps(to_dict(cfg), sort_keys=True)}
        if self.policy is not None and p.mechanism != "none":
            for pool in self.ledger.pool_sigmas():
                row[f"sigma/{pool['name']}"] = pool["effective_noise_multiplier"]
        row.update(summary)
        return row


def check_extractor(model_cfg: Any) -> None:
    """The local checkpoint's feature extractor (preprocessor_config.json) is the one
    :mod:`cluster_fl.data.features` computes -- 16 kHz, hop 160, FFT 400 -- or the run is refused
    naming both values: a model trained on other frames would get features it never saw."""
    from cluster_fl.data.features import HOP, N_FFT, SAMPLE_RATE

    shape = feature_shape(model_cfg)
    ours = {"sampling_rate": SAMPLE_RATE, "hop_length": HOP, "n_fft": N_FFT}
    for key, value in ours.items():
        if getattr(shape, key) != value:
            raise UserError(f"model.arch {model_cfg.arch}: the checkpoint's feature extractor "
                            f"has {key} {getattr(shape, key)} ({shape.source}), the features "
                            f"are computed with {value} (cluster_fl.data.features)")


def load_clients(cfg: Config, log: Callable[[str], None] | None = None
                 ) -> tuple[Any, list[ClientData], list]:
    """Feature store, federated clients (lazy features) and the evaluation set's metadata
    (features are loaded by the lane that decodes them). Clients come from the store's indexes
    (speakers, counts), not from every row's metadata; a client's features are read when it
    trains. A requested language the corpus lacks is an error naming the languages and splits
    it has, unless ``data.allow_missing_languages`` (then ``log`` says which)."""
    from cluster_fl.data import FeatureStore, describe_corpus, find_shards, load_utterances

    check_extractor(cfg.model)
    d = cfg.data
    root = os.path.expanduser(d.corpus)
    if not os.path.isdir(root):
        raise UserError(f"data.corpus: no corpus at {root} (build one with `cluster-fl "
                        "make-corpus DIR` or point data.corpus at an MLS folder)")
    missing = {split: [lang for lang in d.languages if lang not in
                       {s.language for s in find_shards(root, list(d.languages), [split])}]
               for split in dict.fromkeys([d.client_split, d.eval_split])}
    gaps = "; ".join(f"no {', '.join(langs)} in split {split!r}"
                     for split, langs in missing.items() if langs)
    absent = [split for split in missing if set(missing[split]) == set(d.languages)]
    if absent:
        key = "data.client_split" if absent[0] == d.client_split else "data.eval_split"
        raise UserError(f"{key}: the corpus at {root} has no split {absent[0]!r} for "
                        f"{','.join(d.languages)}; {describe_corpus(root)}")
    if gaps and not d.allow_missing_languages:
        raise UserError(f"data.languages: the corpus at {root} has {gaps} "
                        f"({describe_corpus(root)}); remove them from data.languages or set "
                        "data.allow_missing_languages=true")
    if gaps and log is not None:
        log(f"warning: data.languages: {gaps} (data.allow_missing_languages=true)")
    store = FeatureStore.from_config(d)
    clients = store.clients(d.client_split, d.languages, max_clients=d.max_clients,
                            max_utterances_per_client=d.max_utterances_per_client)
    if not clients:
        raise UserError(f"data: no clients in split {d.client_split!r} for languages "
                        f"{','.join(d.languages)} under {root}")
    out = [ClientData(index=c.index, client_id=c.client_id, speaker=c.speaker,
                      language=c.language, utterances=LazyExamples(store, c)) for c in clients]
    eval_utts = load_utterances(root, languages=list(d.languages), splits=[d.eval_split],
                                max_utterances=cfg.eval.max_utterances)
    return store, out, eval_utts


def check_eval_speakers(cfg: Config, clients: list, eval_utts: list, ledger: Any) -> None:
    """In a private run the evaluation speakers must not be clients: eval.parquet releases each
    evaluated utterance's transcript and errors exactly. Secure mode refuses the overlap (one
    line); a research run records its guarantee as void."""
    from cluster_fl.privacy.accounting import EVAL_ON_CLIENTS

    if cfg.privacy.mechanism != "gaussian":
        return
    shared = {c.speaker for c in clients} & {u.speaker for u in eval_utts}
    if not shared:
        return
    if cfg.privacy.secure_mode:
        raise UserError(f"data.eval_split: {len(shared)} evaluation speaker(s) are clients of "
                        f"the run (split {cfg.data.eval_split!r}); a secure run evaluates on "
                        "speakers who are not clients")
    ledger.add_void_reason(EVAL_ON_CLIENTS)


def sharded_from_meta(cfg: Config, layout: LaneLayout) -> bool:
    """Whether this rank builds the base as a meta skeleton and reads only the tensors it holds
    (every tensor unsharded, its rows in a sharded lane) straight onto its device in its dtype:
    every real architecture, whatever the lane size. Tiny random-init variants and
    ``model.checkpoint`` (a tiny pretrain checkpoint) are built whole: a few MB, and their random
    init is what every 1-vs-N comparison starts from."""
    from cluster_fl.models import get_arch

    return cfg.model.checkpoint is None and not get_arch(cfg.model.arch).tiny


def run_lane_steps(cfg: Config, client_sizes: Sequence[int], lanes: int) -> int:
    """A lane's local steps over the whole run, expected: rounds x its share of the expected
    cohort (in blocks of ``fl.clients_per_step``) x a client's mean steps a round (the engine's
    ``local_steps`` over the clients' sizes) -- what a compile has to repay
    (``precision.resolve_compile``)."""
    fl = cfg.fl
    if not client_sizes:
        return 0
    mean_steps = sum(local_steps(n, fl.batch_size, fl.local_epochs, fl.max_local_steps)
                     for n in client_sizes) / len(client_sizes)
    cohort = min(fl.clients_per_round, len(client_sizes))
    blocks = math.ceil(math.ceil(cohort / max(1, lanes)) / max(1, fl.clients_per_step))
    return int(fl.rounds * blocks * mean_steps)


def build_world(cfg: Config, comm: Comm, log: Callable[[str], None]) -> World:
    from cluster_fl.models import (build_model, get_trainable, trainable_groups,
                                   trainable_parameters)
    from cluster_fl.models.build import describe_init
    from cluster_fl.privacy import ledger_for, make_policy, noise_for

    require_resolved(cfg, "build_world")
    store, clients, eval_utts = load_clients(cfg, log if comm.rank == 0 else None)
    # unusable corpus rows are found while features load (a client's turn, the evaluation);
    # train.py logs them by id and counts them per client in the run folder (skipped.json)
    # Random init (LoRA A, and everything when no checkpoint) from (seed, "init") on every rank,
    # so all ranks -- and a 1-rank run -- start from the same global state.
    torch.manual_seed(derive_seed(cfg.seed, "init"))
    layout = LaneLayout(comm.world_size, cfg.model.shard_group_size, comm.rank)
    # device, dtype and compilation derived once (precision.run_precision): a skeleton is
    # allocated in the dtype its lane runs in, never cast again
    device = resolve_device(cfg.run.device, comm.local_rank, comm.local_world_size)
    precision = run_precision(cfg.model.dtype, cfg.model.compile, device.type,
                              run_lane_steps(cfg, [c.size for c in clients], layout.lanes))
    # a fresh connector follows the seed
    model = build_model(cfg.model, meta=sharded_from_meta(cfg, layout), run_seed=cfg.seed,
                        storage_dtype=precision[0])
    # dtype policy, placement, activation checkpointing and lane sharding, from outside the model
    if layout.group_size > 1:  # the lane's collectives (mesh, shards) start once all have loaded
        comm.barrier(slow=True)
    placement = parallelize(model, cfg.model, device, layout, precision)
    if comm.rank == 0:
        log(describe_init(cfg.model))  # random init is said out loud
    groups = trainable_groups(model)
    params = trainable_parameters(model)
    state = get_trainable(model)
    private = cfg.privacy.mechanism == "gaussian"
    policy = make_policy(cfg.privacy, groups) if private else None
    population = len(clients)
    if cfg.fl.clients_per_round > population:
        raise UserError(f"fl.clients_per_round ({cfg.fl.clients_per_round}) exceeds the number "
                        f"of clients ({population})")
    q = sampling_rate(cfg.fl.clients_per_round, population)
    runner = ClientRunner(model, params, groups, cfg.fl, cfg.client, make_batches, cfg.seed,
                          placement)
    noise = noise_for(cfg.privacy, cfg.seed)
    server = ServerOptimizer(cfg.aggregation)
    recorder = ChannelRecorder(run_dir(cfg), comm.rank) if cfg.audit.record_channels else None
    # with the model on the device: data.device_resident=auto weighs the features against
    # the memory left
    feeder = ClientFeeder.for_run(cfg.data.device_resident, device, clients, cfg.data.n_mels)
    engine = RoundEngine(cfg, comm, runner, groups, clients, policy, noise, server, recorder,
                         layout=layout, device=device, feeder=feeder)
    e = cfg.eval
    evaluation = ShardedEvaluation(store, eval_utts, layout, e.batch_size, e.max_new_tokens,
                                   e.bootstrap, cfg.seed, decode_cache=e.decode_cache)
    ledger = RunLedger(ledger_for(cfg, population), policy,
                       record_channels=cfg.audit.record_channels)
    check_eval_speakers(cfg, clients, eval_utts, ledger.ledger)
    if comm.rank == 0:
        log(f"{population} clients, q={q:.3f}, {len(groups)} trainable groups "
            f"({sum(g.numel for g in groups):,} parameters), {comm.world_size} rank(s) in "
            f"{layout.lanes} lane(s) of {layout.group_size}, {device}{feeder.describe()}, base "
            f"{str(placement.dtype).removeprefix('torch.')}"
            f"{' (compiled step)' if placement.compiled_layers else ''}, malloc {active_malloc()}, "
            + (f"DP {cfg.privacy.clipping} C={cfg.privacy.clip_norm} "
               f"sigma={cfg.privacy.noise_multiplier}" if private else "NON-PRIVATE FedAvg"))
    return World(cfg, model, groups, state, policy, ledger, server, engine, evaluation,
                 population, placement, comm)



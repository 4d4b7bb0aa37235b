"""Typed run configuration: one frozen, keyword-only dataclass per concern.

A config is built from YAML presets (``configs/``) plus ``key=value`` overrides. Every field is
validated where it is declared; a bad value raises :class:`ConfigError` naming the key and the
allowed values, and an unknown key names the nearest valid keys. The CLI turns a ``ConfigError``
into one line on stderr and exit code 2.

Presets may inherit: a top-level ``base: other.yaml`` (path relative to the preset, or a list of
them) is loaded first and the preset's own keys override it. This module is the schema; reading
presets and overrides lives in :mod:`cluster_fl.config.load`, which imports it (never the other
way round); the checks the keys are validated with, in :mod:`cluster_fl.config.checks`;
:mod:`cluster_fl.config` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from cluster_fl.config.checks import check as _check
from cluster_fl.config.checks import in_range as _range
from cluster_fl.config.checks import one_of as _in

from cluster_fl.config.schema_privacy import (CLIPPING_METHODS, COMPONENTS, GROUPINGS,  # noqa: F401
                                              INSIDE_POOL_RULES, AggregationConfig, AuditConfig,
                                              PrivacyConfig)

DECODE_CACHES = ("auto", "static", "dynamic")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which speech-LLM to build and how to adapt it."""

    arch: str = "whisper-tinyllama-tiny"
    """Registry name (see ``cluster_fl.models.registry``), e.g. ``whisper-tinyllama-tiny``."""
    freeze_encoder: bool = False
    """Frozen-encoder variant: no encoder LoRA is trained."""
    lora_rank: int = 4
    """LoRA rank on q/k/v of encoder and decoder."""
    lora_alpha: float = 8.0
    """LoRA scale numerator (PEFT ``lora_alpha``)."""
    lora_dropout: float = 0.0
    """LoRA dropout probability."""
    checkpoint: str | None = None
    """Directory of a ``cluster-fl pretrain`` checkpoint (tiny models) to start from."""
    connector_init: str = "checkpoint"
    """``checkpoint``: the connector as ``model.checkpoint`` holds it. ``fresh``: re-initialise it
    (PyTorch's default init, seed ``connector_seed``) after loading a pretrained (LoRA-free)
    checkpoint -- the paper's starting point, a new projector between a pretrained encoder and a
    pretrained LLM that the federated stage has to learn."""
    connector_seed: int | None = None
    """Seed of the ``fresh`` connector init. ``null`` (default): the run's seed (``run.seed``; 0
    for a secure-mode run), so the seeds of a study start from different connectors and its
    round-0 differs per seed (every method of one seed shares it); an integer pins one init for
    every seed. Unused (``null``) with ``connector_init: checkpoint``."""
    init: str = "auto"
    """Where the base's weights come from -- random init is a decision, never an accident.
    ``auto``: the checkpoints the config names; a real architecture then requires them
    (``encoder_path`` / ``decoder_path``), a tiny one without ``model.checkpoint`` starts from
    random weights and the run says so at its start. ``random``: random weights on purpose, also
    for a real architecture (built at its registry widths; no checkpoint may be named).
    ``pretrained``: refuse to start without a checkpoint, tiny architectures included."""
    encoder_path: str | None = None
    """Local path / HF-cache name of the real audio encoder (``from_pretrained``; never downloads)."""
    decoder_path: str | None = None
    """Local path / HF-cache name of the real LLM decoder."""
    tokenizer_path: str | None = None
    """Local path of the tokenizer (defaults to the decoder's)."""
    layout: tuple[Mapping[str, Any], ...] | None = None
    """Explicit parameter layout ``[{name, component, numel}, ...]`` used by ``thresholds``
    instead of building the model (for sizing a huge model without loading it)."""
    dtype: str = "auto"
    """Storage dtype of the frozen base: ``float32``, ``bfloat16``, ``float16`` or ``auto``
    (bfloat16 on CUDA, and on CPUs with AMX-BF16 or AVX512-BF16 when the step is compiled --
    eagerly, autocast's casts cost a CPU more than its faster matmuls save; float32 elsewhere).
    LoRA and the connector stay fp32 master weights (updates, clipping and the secure sum are
    fp32 or wider); compute runs under autocast in this dtype."""
    compile: bool | str = "auto"
    """``torch.compile`` each encoder and decoder layer of the training step (inductor: C++ on
    CPU, Triton on GPU; forward and backward) with symbolic shapes, so a run compiles one graph
    per layer type; a sharded lane (``model.shard: fsdp2``) compiles the same layers, FSDP2's
    gathers staying outside the graphs. ``auto``: on CUDA and on CPUs with AMX-BF16/AVX512-BF16;
    on other CPUs when a lane's local steps over the run repay the compile
    (``precision.COMPILE_PAYS_AFTER_STEPS``, docs/speed.md); environment
    ``CLUSTER_FL_COMPILE=0``/``1`` decides ``auto`` instead; ``true`` / ``false``."""
    activation_checkpointing: bool = False
    """Recompute each encoder/decoder layer's activations in the backward pass (less memory)."""
    pad_to_window: bool = False
    """Pad the encoder's input to its whole window (Whisper: 30 s, 3,000 mel frames) with the
    utterance's silence level and attend over all of it, as Whisper was trained -- the choice
    for a frozen pretrained encoder; the connector still takes only the utterance's own frames.
    ``false`` (the default, faster): the encoder sees the utterance alone, padding masked. On
    2-20 s MLS utterances padding costs ~1.5-15x the encoder's work."""
    shard: str = "none"
    """Sharding of the frozen base inside a client lane: ``none`` or ``fsdp2`` (DeepSpeed ZeRO-3
    was removed in favour of FSDP2; ARCHITECTURE.md says why)."""
    shard_group_size: int = 1
    """G: ranks per client lane. The world splits into world/G lanes; the ranks of a lane train one
    client at a time together with the base sharded over them (G > 1 needs ``shard``)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.arch, str) and self.arch != "", "model.arch", "must be a name")
        _in(self.dtype, ("float32", "bfloat16", "float16", "auto"), "model.dtype")
        _check(isinstance(self.pad_to_window, bool), "model.pad_to_window",
               f"got {self.pad_to_window!r}; must be true or false")
        _check(self.compile in (True, False, "auto"), "model.compile",
               f"got {self.compile!r}; allowed: true, false, auto")
        _in(self.connector_init, ("checkpoint", "fresh"), "model.connector_init")
        _in(self.init, ("auto", "pretrained", "random"), "model.init")
        named = [k for k in ("checkpoint", "encoder_path", "decoder_path") if getattr(self, k)]
        _check(self.init != "random" or not named, "model.init",
               f"random builds the base from random weights, yet model.{named[0] if named else ''}"
               " names a checkpoint; drop one of them")
        _check(self.connector_init == "checkpoint" or self.checkpoint is not None,
               "model.connector_init", "fresh re-initialises the connector of model.checkpoint; "
               "set model.checkpoint (without one every weight is fresh already)")
        if self.connector_init == "checkpoint":  # no connector is drawn: nothing to seed
            object.__setattr__(self, "connector_seed", None)
        if self.connector_seed is not None:
            _range(self.connector_seed, "model.connector_seed", 0, None, integer=True)
        _in(self.shard, ("none", "fsdp2"), "model.shard")
        _range(self.shard_group_size, "model.shard_group_size", 1, 4096, integer=True)
        _check(self.shard_group_size == 1 or self.shard != "none", "model.shard_group_size",
               f"got {self.shard_group_size}; a lane of several ranks needs model.shard "
               "fsdp2")
        _range(self.lora_rank, "model.lora_rank", 1, 4096, integer=True)
        _range(self.lora_alpha, "model.lora_alpha", 0.0, None, lo_open=True)
        _range(self.lora_dropout, "model.lora_dropout", 0.0, 1.0, hi_open=True)
        if self.layout is not None:
            object.__setattr__(self, "layout", tuple(dict(g) for g in self.layout))
            for i, g in enumerate(self.layout):
                key = f"model.layout[{i}]"
                _check(set(g) >= {"name", "component", "numel"}, key,
                       "each group needs name, component and numel")
                _range(g["numel"], key + ".numel", 1, None, integer=True)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the speech comes from and how it is split into clients."""

    corpus: str = "~/.cache/cluster_fl/corpus-v3"
    """Corpus root: the embedded synthetic corpus, or a real MLS copy in either layout --
    Hugging Face Parquet or OpenSLR (``mls_<language>/<split>/transcripts.txt`` + FLAC/Opus),
    detected per language folder (docs/mls.md); the default is the cache folder of
    ``cluster-fl demo`` (``data.corpus.DEFAULT_FOLDER``)."""
    languages: tuple[str, ...] = ("en", "de", "nl", "fr", "es", "it", "pt", "pl")
    """Languages to use."""
    client_split: str = "private"
    """Split whose speakers become federated clients (the embedded corpus: ``private``; real
    MLS: ``train``)."""
    eval_split: str = "test"
    """Split used for the final WER (real MLS: ``test``; ``dev`` to pick learning rates)."""
    public_split: str = "public"
    """Split of public speakers, never clients: ``calibrate``'s probe and central pretraining
    (the embedded corpus: ``public``; real MLS: ``dev``)."""
    max_clients: int = 0
    """Use at most this many clients (0 = all)."""
    max_utterances_per_client: int = 0
    """Cap on a client's utterances, its first by id (0 = no cap): bounds a client's local work
    (an MLS speaker has up to ~2,000 utterances)."""
    feature_cache: str | None = None
    """Directory of the features store (default: ``<corpus>/features``), filled ahead of
    training by ``cluster-fl features`` or on a client's first turn (``data/store.py``)."""
    n_mels: int = 0
    """Mel bins of the log-mel features; 0 = the model's (``models.registry.feature_shape``: the
    local checkpoint's config.json or the registry -- tiny variants 80, whisper-large-v3 and
    Voxtral 128). Resolved when a config is read (the stored config holds the number); a value
    that contradicts the model is refused."""
    allow_missing_languages: bool = False
    """A language of ``languages`` that the corpus lacks (in the client or evaluation split) is
    an error; ``true`` trains on the languages present and logs the missing ones."""
    device_resident: str = "auto"
    """Where a run's client features live while it trains (``engine/feeder.py``): ``true`` --
    copied to the run's GPU the first time a client trains and kept there, every batch padded
    on the device (refused at start when they cannot fit); ``false`` -- streamed from pinned
    host memory, each block's copy issued one block ahead; ``auto`` -- resident when they take
    at most a quarter of the GPU's free memory with the model on it (estimated from the
    utterances' durations), streamed otherwise. A CPU run packs a client's features when it
    trains, whatever the value. Results do not depend on it (bit for bit)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "languages", tuple(self.languages))
        if isinstance(self.device_resident, bool):  # YAML's true/false
            object.__setattr__(self, "device_resident", str(self.device_resident).lower())
        _in(self.device_resident, ("auto", "true", "false"), "data.device_resident")
        if self.n_mels != 0:
            _range(self.n_mels, "data.n_mels", 8, 256, integer=True)
        _check(len(self.languages) > 0, "data.languages", "needs at least one language")
        _check(isinstance(self.allow_missing_languages, bool), "data.allow_missing_languages",
               f"got {self.allow_missing_languages!r}; must be true or false")
        _range(self.max_clients, "data.max_clients", 0, None, integer=True)
        _range(self.max_utterances_per_client, "data.max_utterances_per_client", 0, None,
               integer=True)


@dataclass(frozen=True, kw_only=True)
class FLConfig:
    """The federated schedule: rounds, cohorts, local work."""

    rounds: int = 5
    """Number of federated rounds T."""
    clients_per_round: int = 8
    """Cohort size (fixed sampling) or expected cohort size q·N (Poisson)."""
    sampling: str = "poisson"
    """Cohort sampling: ``poisson`` (each client independently with q) or ``fixed``."""
    local_epochs: int = 1
    """Local epochs E per client per round."""
    batch_size: int = 16
    """Local batch size B."""
    lr: float = 1e-3
    """Peak local learning rate (AdamW, cosine decay)."""
    max_local_steps: int = 0
    """Cap on local optimiser steps per round (0 = no cap)."""
    clients_per_step: int = 1
    """Clients of a rank's shard trained together in one batched forward/backward (shared frozen
    base, per-client LoRA + connector stacked on a client axis); 1 = one client at a time."""
    rows_per_pass: int = 0
    """Batched steps (``clients_per_step`` > 1): utterances per forward/backward pass, whole
    clients per pass (0 = all K x B rows in one pass; a bound for a device short of memory)."""

    def __post_init__(self) -> None:
        _range(self.rounds, "fl.rounds", 1, None, integer=True)
        _range(self.clients_per_round, "fl.clients_per_round", 1, None, integer=True)
        _in(self.sampling, ("poisson", "fixed"), "fl.sampling")
        _range(self.local_epochs, "fl.local_epochs", 1, None, integer=True)
        _range(self.batch_size, "fl.batch_size", 1, None, integer=True)
        _range(self.lr, "fl.lr", 0.0, 10.0, lo_open=True)
        _range(self.max_local_steps, "fl.max_local_steps", 0, None, integer=True)
        _range(self.clients_per_step, "fl.clients_per_step", 1, None, integer=True)
        _range(self.rows_per_pass, "fl.rows_per_pass", 0, None, integer=True)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Local optimiser details of one client."""

    lr_encoder_mult: float = 1.0
    """Learning-rate multiplier for encoder groups (0.1 gives the paper's ~12× norm ratio)."""
    lr_connector_mult: float = 1.0
    """Learning-rate multiplier for connector groups."""
    lr_decoder_mult: float = 1.0
    """Learning-rate multiplier for decoder groups."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps before the cosine decay."""
    max_grad_norm: float = 0.0
    """Local gradient-norm clip for optimiser stability (0 = off; not a privacy mechanism)."""

    def __post_init__(self) -> None:
        for name in ("lr_encoder_mult", "lr_connector_mult", "lr_decoder_mult"):
            _range(getattr(self, name), f"client.{name}", 0.0, 1000.0)
        _range(self.weight_decay, "client.weight_decay", 0.0, 1.0)
        _range(self.warmup_steps, "client.warmup_steps", 0, None, integer=True)
        _range(self.max_grad_norm, "client.max_grad_norm", 0.0, None)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Word error rate evaluation."""

    every: int = 0
    """Evaluate every this many rounds (0 = only after the last round)."""
    max_utterances: int = 400
    """Cap on evaluated utterances (0 = all), taken speaker-stratified."""
    batch_size: int = 32
    """Decoding batch size."""
    max_new_tokens: int | str = "auto"
    """Greedy decoding length limit (tokens), or ``auto``: the evaluation set's longest reference
    in the model's tokens plus a quarter (at least 8 tokens; ``eval.decode_budget``), so a long
    German or Polish utterance is not cut. Hypotheses cut by the limit are counted and reported
    beside the WER (``hypotheses_cut``)."""
    decode_cache: str = "auto"
    """Greedy decoding's KV cache: ``static`` (cache, masks and token buffer allocated once, the
    host checks for the end every 8 tokens: on a GPU each check is a synchronisation), ``dynamic``
    (Hugging Face's growing cache, a check every token) or ``auto`` (static on a GPU; on a CPU
    the faster of the two, measured by ``bench/decode_bench.py``). Both give the same tokens."""
    bootstrap: int = 1000
    """Speaker-clustered bootstrap resamples for the 95% CI."""

    def __post_init__(self) -> None:
        _range(self.every, "eval.every", 0, None, integer=True)
        _range(self.max_utterances, "eval.max_utterances", 0, None, integer=True)
        _range(self.batch_size, "eval.batch_size", 1, None, integer=True)
        if self.max_new_tokens != "auto":
            _range(self.max_new_tokens, "eval.max_new_tokens", 1, None, integer=True)
        _in(self.decode_cache, DECODE_CACHES, "eval.decode_cache")
        _range(self.bootstrap, "eval.bootstrap", 0, None, integer=True)


PATH_MAX, NAME_MAX = 4096, 255  # Linux's limits on a path and on one of its names (bytes)


def _path(value: Any, key: str) -> None:
    """A path (or folder name) the file system can hold: one line naming the key instead of an
    OSError traceback ("File name too long") when the run creates its folder."""
    if value is None:
        return
    _check(isinstance(value, str) and value != "", key, f"got {value!r}; must be a path")
    size = len(value.encode())
    _check(size <= PATH_MAX, key, f"a path of {size:,} bytes; at most {PATH_MAX}")
    longest = max((len(part.encode()) for part in value.split("/")), default=0)
    _check(longest <= NAME_MAX, key, f"a file or folder name of {longest:,} bytes; at most "
           f"{NAME_MAX}")


TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Bookkeeping: seed, output folder, checkpoints, threads."""

    seed: int | None = 0
    """Root seed: cohorts, client training and research-mode noise derive from it. Null only in
    ``privacy.secure_mode``, which refuses a seed (see :func:`build_config`)."""
    out: str = "results"
    """Results root; a run writes ``<out>/<experiment>/<run_id>/``."""
    experiment: str = "default"
    """Experiment name (first folder level)."""
    run_id: str | None = None
    """Run folder name (default: derived from the resolved config)."""
    nonce: str | None = None
    """Random id (32 hex digits) drawn at a run's first start and stored in its config.yaml,
    privacy.json and checkpoint; every resume compares the three, so another run's checkpoint
    and ledger copied into the folder are refused even when the configs are equal. Left null:
    the engine sets it (a value given must be the folder's)."""
    checkpoint_every: int = 1
    """Write an atomic checkpoint every this many rounds."""
    threads: int = 0
    """torch intra-op threads per rank (0 = cores ÷ local ranks)."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto``."""
    timeout_s: int = 60
    """Dead-peer timeout: a collective between ranks that should all be ready (broadcast of the
    noised sum, barriers) fails after this many seconds."""
    wait_timeout_s: int = 7200
    """Limit for collectives that wait for the slowest lane (its share of the cohort's training,
    the sharded evaluation); a killed rank still fails them at once."""
    report_to: tuple[str, ...] = ()
    """Experiment trackers that receive the config, each round's released values (noised
    diagnostics, ε so far) and the evaluations -- never the operator log: any of
    ``tensorboard``, ``wandb``, ``mlflow`` (several allowed; ``[]`` or ``none``: none). They write
    under ``<out>/<experiment>/.trackers/``; each needs its package (``pip install
    'cluster_fl[trackers]'``). W&B runs offline unless ``WANDB_MODE`` says otherwise."""

    def __post_init__(self) -> None:
        report = (self.report_to,) if isinstance(self.report_to, str) else tuple(self.report_to)
        object.__setattr__(self, "report_to", tuple(t for t in report if t != "none"))
        for tracker in self.report_to:
            _in(tracker, TRACKERS, "run.report_to")
        if self.seed is not None:
            _range(self.seed, "run.seed", 0, 2**63 - 1, integer=True)
        _path(self.out, "run.out")
        _path(self.experiment, "run.experiment")
        _path(self.run_id, "run.run_id")
        _check(self.nonce is None or (isinstance(self.nonce, str) and len(self.nonce) == 32
                                      and all(c in "0123456789abcdef" for c in self.nonce)),
               "run.nonce", f"got {self.nonce!r}; 32 hex digits, set by the engine (leave null)")
        _range(self.checkpoint_every, "run.checkpoint_every", 1, None, integer=True)
        _range(self.threads, "run.threads", 0, 1024, integer=True)
        _in(self.device, ("cpu", "cuda", "auto"), "run.device")
        _range(self.timeout_s, "run.timeout_s", 1, None, integer=True)
        _range(self.wait_timeout_s, "run.wait_timeout_s", 1, None, integer=True)


@dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    """Central pretraining of a tiny speech-LLM on the public speakers (``cluster-fl pretrain``)."""

    minutes: float = 15.0
    """With ``steps`` > 0: a wall-clock cap per call in minutes (0 = none); when it runs out
    before the step budget the unfinished checkpoint is saved and the command fails (run it again
    to resume). With ``steps`` = 0: the budget itself, which makes the checkpoint depend on the
    machine's speed."""
    steps: int = 0
    """Optimiser steps: the budget (0 = budget in ``minutes`` of wall clock). The schedule, the
    warm-start and the data order follow the step count and ``run.seed``, so the checkpoint is
    the same on a fast and a slow machine."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to ``final_lr`` x lr)."""
    final_lr: float = 0.1
    """Learning rate at the end of the cosine decay, as a fraction of ``lr``."""
    warmup_steps: int = 200
    """Linear warm-up steps."""
    batch_size: int = 24
    """Utterances per step."""
    ctc_weight: float = 0.5
    """Weight of the auxiliary CTC loss on the encoder (0 = off)."""
    ctc_warmstart: float = 0.3
    """Share of the budget (steps, or time when ``steps`` = 0) that trains only the encoder on
    CTC, before joint training (0 = joint from the start). CTC-only steps are cheaper, so 30% of
    the time was ~43% of the steps. With ``mode: separate``: the encoder's share."""
    mode: str = "joint"
    """``joint``: the whole speech-LLM trains on the public speakers (after the CTC warm-start).
    ``separate``: the paper's starting point -- the encoder trains on CTC (audio of the public
    speakers), then the decoder trains alone as a character LM on their transcripts; the
    connector keeps its random init and the decoder never sees audio, so the federated stage
    has to learn the speech-to-LLM mapping."""
    heldout_speakers: int = 8
    """Public speakers per language held out to measure WER during pretraining. Per-speaker WER
    spreads widely (SD ~0.19 between voices), so 2 per language made a yardstick that moved by
    ~0.05 with the draw; 8 (64 speakers) keeps that under ~0.025."""
    eval_every: int = 1000
    """Evaluate held-out WER (and checkpoint) every this many steps (0 = only at the end)."""
    eval_utterances: int = 400
    """Cap on held-out utterances decoded per evaluation (0 = all)."""
    out: str = "~/.cache/cluster_fl/pretrain/whisper-tinyllama-tiny"
    """Checkpoint directory written atomically (use it as ``model.checkpoint``)."""

    def __post_init__(self) -> None:
        _range(self.minutes, "pretrain.minutes", 0.0, None)
        _range(self.steps, "pretrain.steps", 0, None, integer=True)
        _check(self.minutes > 0 or self.steps > 0, "pretrain.steps",
               "set pretrain.steps > 0 or pretrain.minutes > 0")
        _range(self.lr, "pretrain.lr", 0.0, 10.0, lo_open=True)
        _range(self.final_lr, "pretrain.final_lr", 0.0, 1.0)
        _range(self.warmup_steps, "pretrain.warmup_steps", 0, None, integer=True)
        _range(self.batch_size, "pretrain.batch_size", 1, None, integer=True)
        _range(self.ctc_weight, "pretrain.ctc_weight", 0.0, 100.0)
        _range(self.ctc_warmstart, "pretrain.ctc_warmstart", 0.0, 1.0, hi_open=True)
        _check(self.mode in ("joint", "separate"), "pretrain.mode",
               f"must be joint or separate, got {self.mode!r}")
        _check(self.mode == "joint" or self.ctc_warmstart > 0.0, "pretrain.ctc_warmstart",
               "mode separate trains the encoder in the first ctc_warmstart of the budget; "
               "set it > 0")
        _range(self.heldout_speakers, "pretrain.heldout_speakers", 0, None, integer=True)
        _range(self.eval_every, "pretrain.eval_every", 0, None, integer=True)
        _range(self.eval_utterances, "pretrain.eval_utterances", 0, None, integer=True)
        _check(isinstance(self.out, str) and self.out != "", "pretrain.out", "must be a path")


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole resolved configuration of one run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    fl: FLConfig = field(default_factory=FLConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        # a lane of G > 1 ranks trains one client at a time (each member a slice of its batch)
        _check(self.fl.clients_per_step == 1 or self.model.shard_group_size == 1,
               "fl.clients_per_step",
               f"got {self.fl.clients_per_step} with model.shard_group_size "
               f"{self.model.shard_group_size}; batched clients need unsharded lanes "
               "(model.shard_group_size: 1) -- use fl.clients_per_step: 1 with sharded lanes")
        # secure mode promises that no rank sees another's partial sum: that needs the masks
        _check(not (self.privacy.secure_mode and not self.aggregation.secure_sum),
               "aggregation.secure_sum",
               "privacy.secure_mode needs the masked secure sum (aggregation.secure_sum: true); "
               "without it every rank's partial sum crosses the wire in the clear")
        # eval.parquet holds every utterance's transcript and exact errors: in a secure run they
        # may not be the clients' (a research run on the clients' split is recorded void)
        _check(not (self.privacy.secure_mode and self.privacy.mechanism == "gaussian"
                    and self.data.eval_split == self.data.client_split), "data.eval_split",
               f"got {self.data.eval_split!r}, the clients' split (data.client_split): a secure "
               "run evaluates on speakers who are not clients (eval.parquet releases each "
               "utterance's transcript and errors exactly); use another split, e.g. test")

    @property
    def seed(self) -> int:
        """The run's root seed, for code that runs the experiment: a secure-mode config has
        none until the engine draws one at start (its working config), and asking before that
        is a bug, not a seed of 0."""
        if self.run.seed is None:
            raise ValueError("run.seed is drawn at start in secure mode: build the run from the "
                             "engine's working config")
        return self.run.seed


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "fl": FLConfig, "client": ClientConfig,
    "privacy": PrivacyConfig, "aggregation": AggregationConfig, "eval": EvalConfig,
    "audit": AuditConfig, "pretrain": PretrainConfig, "run": RunConfig,
}

"""Pre-flight: what `cluster-fl grid` checks before anything is queued, so nothing doomed reaches
the queue.

Every submission runs :func:`preflight`; ``--dry-run`` runs it too and also prints, per job, its
resources and ``plan``'s memory and round-time estimate (:func:`job_lines`). Each problem is one
:class:`Problem` -- the cell (or ``grid``) and the key -- and the command exits 2 with nothing
queued. What is checked:

* **inputs** (what the engine reads; skipped when a caller injects its own training function):
  every cell's config is valid (all cells, not the first bad one); no placeholder
  (``/path/to/...``, ``<...>``, ``CHANGEME``) and no missing path among ``data.corpus``,
  ``model.checkpoint``, ``model.encoder_path``, ``model.decoder_path``, ``model.tokenizer_path``;
  the corpus holds every language of ``data.languages`` in the client and evaluation splits; a
  real architecture has its checkpoint folders (or ``model.init: random`` said on purpose), each
  with a ``config.json``, safetensors weights and -- the decoder's -- a tokenizer, and the
  tensors' shapes agree with the architecture built from that config (read from the files'
  headers only, nothing is loaded);
* **features**: the feature store of each corpus is counted (complete, or how many parts are
  missing: :func:`features_line`); on SLURM the features array job that ``grid`` submits first
  fills it, and its request is checked like the runs' (:func:`check_features_request`);
* **SLURM** (``--cluster slurm`` only; ``local`` and ``debug`` never ask): ``sinfo`` answers,
  the partition exists, the request fits a node of it (CPUs, GPUs, memory, nodes), and
  ``sbatch --test-only`` with the grid's partition, account, QoS and resources accepts it.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from cluster_fl.config import Config, ConfigError
from cluster_fl.errors import UserError, short_reason
from cluster_fl.sweep.features_job import stores_to_fill
from cluster_fl.sweep.gridspec import Grid, RunSpec, expand

# what grid files and presets write where a user has to fill something in
PLACEHOLDER = re.compile(r"^/path/to\b|<[^>]*>|\bCHANGEME\b|\bFILL[ _-]?IN\b|\bTODO\b",
                         re.IGNORECASE)
PATH_KEYS = ("data.corpus", "model.checkpoint", "model.encoder_path", "model.decoder_path",
             "model.tokenizer_path")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class Problem:
    """One reason a grid must not be queued: where (a cell, or ``grid``) and which key."""

    cell: str
    key: str
    message: str

    def line(self) -> str:
        return f"{self.cell}: {self.key}: {self.message}"


class PreflightFailed(UserError):
    """Pre-flight found problems; ``problems`` holds them (the message is the first)."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        super().__init__(self.problems[0].line())


# --------------------------------------------------------------------------- configs and inputs

def expand_cells(grid: Grid, extra: Mapping[str, Any] | None = None
                 ) -> tuple[list[RunSpec], list[Problem]]:
    """Every cell x seed whose config is valid, and one problem per invalid cell."""
    problems: list[Problem] = []
    specs = expand(grid, extra, errors=problems_sink(problems))
    return specs, problems


def problems_sink(problems: list[Problem]) -> Any:
    """A callback for :func:`~cluster_fl.sweep.gridspec.expand` collecting invalid cells."""
    def add(cell: str, exc: UserError) -> None:
        if isinstance(exc, ConfigError):
            problems.append(Problem(cell, exc.key, str(exc).split(": ", 1)[-1]))
        else:
            problems.append(Problem(cell, "model", str(exc)))
    return add


def placeholder(value: str) -> bool:
    """Whether ``value`` is a template's fill-in rather than a path."""
    return bool(PLACEHOLDER.search(value))


def check_inputs(specs: Sequence[RunSpec]) -> list[Problem]:
    """The inputs every run of ``specs`` reads (module docstring), one problem per cell and key
    (a problem shared by several seeds of a cell is reported once)."""
    problems: dict[tuple[str, str, str], Problem] = {}
    for spec in specs:
        for problem in _cell_inputs(spec.cell, spec.config):
            problems.setdefault((problem.cell, problem.key, problem.message), problem)
    return list(problems.values())


def _cell_inputs(cell: str, cfg: Config) -> list[Problem]:
    from cluster_fl.models.registry import get_arch

    out: list[Problem] = []
    bad_paths: set[str] = set()
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None:
            continue
        if placeholder(str(value)):
            out.append(Problem(cell, key, f"{value!r} is a placeholder; fill in a local path"))
            bad_paths.add(key)
        elif not _exists(key, str(value)):
            out.append(Problem(cell, key, f"{value} does not exist"
                               + (" (nor is it in the local Hugging Face cache)"
                                  if key.startswith("model.") and "_path" in key else "")))
            bad_paths.add(key)
    if "data.corpus" not in bad_paths:
        out += [Problem(cell, k, m) for k, m in _corpus_gaps(
            str(Path(cfg.data.corpus).expanduser()), tuple(cfg.data.languages),
            cfg.data.client_split, cfg.data.eval_split, cfg.data.allow_missing_languages)]
    spec = get_arch(cfg.model.arch)
    m = cfg.model
    if m.checkpoint is not None:
        if "model.checkpoint" not in bad_paths:
            out += [Problem(cell, k, msg) for k, msg in _pretrain_checkpoint(m.checkpoint)]
        return out
    if spec.tiny or getattr(m, "init", "auto") == "random":
        return out
    folders = _checkpoint_keys(cfg)
    for key, folder in folders.items():
        if folder is None:
            default = spec.defaults.get(key.split(".")[1].split("_")[0], "a local folder")
            out.append(Problem(cell, key, f"model.arch {spec.name} needs a local checkpoint "
                               f"folder (e.g. of {default}), or model.init=random to train "
                               "from random weights on purpose"))
        elif key not in bad_paths:
            out += [Problem(cell, key, msg) for msg in _folder_files(folder, key)]
    if not any(p.key.startswith("model.") for p in out):
        out += [Problem(cell, k, msg) for k, msg in _shape_problems(m)]
    return out


def _exists(key: str, value: str) -> bool:
    """A path that exists; for checkpoint folders also a repository name in the local HF cache."""
    if Path(value).expanduser().exists():
        return True
    if key in ("model.encoder_path", "model.decoder_path", "model.tokenizer_path"):
        from cluster_fl.models.weights import checkpoint_folder

        return checkpoint_folder(value).is_dir()
    return False


def _checkpoint_keys(cfg: Config) -> dict[str, str | None]:
    """The checkpoint folders a real architecture reads, by config key."""
    from cluster_fl.models.registry import get_arch

    m = cfg.model
    if get_arch(m.arch).family == "voxtral":
        return {"model.decoder_path": m.decoder_path or m.encoder_path}
    return {"model.encoder_path": m.encoder_path, "model.decoder_path": m.decoder_path}


def _folder_files(folder: str, key: str) -> list[str]:
    """What a Hugging Face checkpoint folder lacks: config, safetensors weights, a tokenizer
    (the decoder's, read unless model.tokenizer_path names another)."""
    from cluster_fl.models.weights import checkpoint_folder

    path = checkpoint_folder(folder)
    if not path.is_dir():
        return [f"{folder} is not a folder (a save_pretrained output: config.json, "
                "model.safetensors, tokenizer)"]
    missing = []
    if not (path / "config.json").is_file():
        missing.append(f"{folder} has no config.json")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        bins = any(path.glob("*.bin"))
        missing.append(f"{folder} has no model.safetensors (or index)"
                       + ("; only pickled *.bin weights: convert them with save_pretrained "
                          "(safetensors), which the loader reads tensor by tensor" if bins else ""))
    if key == "model.decoder_path" and not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"{folder} has no tokenizer (tokenizer.json / tokenizer.model); set "
                       "model.tokenizer_path")
    return missing


@functools.lru_cache(maxsize=64)
def _corpus_gaps(root: str, languages: tuple[str, ...], client_split: str, eval_split: str,
                 allow_missing: bool) -> list[tuple[str, str]]:
    from cluster_fl.data.mls import find_shards

    if not Path(root).is_dir():
        return [("data.corpus", f"{root} is not a folder")]
    try:
        shards = find_shards(root, list(languages))
    except UserError as exc:
        return [("data.corpus", str(exc))]
    have = {(s.language, s.split) for s in shards}
    gaps = [f"no {', '.join(lang for lang in languages if (lang, split) not in have)} in split "
            f"{split!r}" for split in dict.fromkeys([client_split, eval_split])
            if any((lang, split) not in have for lang in languages)]
    if not gaps or allow_missing:
        return []
    return [("data.languages", f"the corpus at {root} has {'; '.join(gaps)}")]


def _pretrain_checkpoint(path: str) -> list[tuple[str, str]]:
    from cluster_fl.models.checkpoint import read_meta

    try:
        read_meta(path)
    except (UserError, OSError, ValueError) as exc:
        return [("model.checkpoint", short_reason(exc))]
    return []


def _shape_problems(model_cfg: Any) -> list[tuple[str, str]]:
    """The checkpoint tensors' shapes against the architecture built from the folders'
    config.json, on the meta device (file headers only)."""
    key = (model_cfg.arch, model_cfg.encoder_path, model_cfg.decoder_path)
    return _shape_problems_cached(*key)


@functools.lru_cache(maxsize=16)
def _shape_problems_cached(arch: str, encoder_path: str | None, decoder_path: str | None
                           ) -> list[tuple[str, str]]:
    from cluster_fl.config import ModelConfig
    from cluster_fl.models.build import build_skeleton, checkpoint_weights
    from cluster_fl.models.registry import get_arch

    cfg = ModelConfig(arch=arch, encoder_path=encoder_path, decoder_path=decoder_path)
    try:
        skeleton = build_skeleton(cfg)
        checkpoint_weights(get_arch(arch), cfg).check(skeleton)
    except UserError as exc:
        text = str(exc)
        which = ("model.encoder_path" if text.startswith("encoder.") and
                 get_arch(arch).family != "voxtral" else "model.decoder_path")
        return [(which, text)]
    except (OSError, ValueError, TypeError) as exc:  # a config.json transformers rejects
        return [("model.decoder_path" if decoder_path else "model.encoder_path",
                 f"cannot build the architecture from the checkpoint's config.json "
                 f"({short_reason(exc)})")]
    return []


# --------------------------------------------------------------------------- features

def features_line(cfg: Config) -> str:
    """One line on the feature store of a (resolved) config: complete, or how many parts are
    missing and who fills them (the features array job ``grid --cluster slurm`` submits first;
    elsewhere ``cluster-fl features`` or the runs themselves, on first use)."""
    return _features_line(cfg.data)


@functools.lru_cache(maxsize=64)
def _features_line(data: Any) -> str:
    from cluster_fl.data.store import FeatureStore, config_missing

    if not Path(data.corpus).expanduser().is_dir() or not data.n_mels:
        return "features: unknown (no corpus)"
    where, missing = FeatureStore.from_config(data).cache_dir, config_missing(data)
    if missing < 0:
        return f"features: unknown (the corpus cannot be read from here; {where})"
    if missing == 0:
        return f"features: complete ({where})"
    return (f"features: {missing} part(s) missing ({where}); on SLURM the features "
            "job fills them first, elsewhere `cluster-fl features` or the runs on first use")


# --------------------------------------------------------------------------- SLURM

def _slurm_run(cmd: list[str]) -> subprocess.CompletedProcess | str:
    """Run a SLURM client command; a string says why it could not answer."""
    if shutil.which(cmd[0]) is None:
        return f"{cmd[0]} is not on PATH (no SLURM client on this machine)"
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return f"{cmd[0]} did not answer in 60 s"
    except OSError as exc:
        return f"{cmd[0]}: {short_reason(exc)}"


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln
    return lines[0] if lines else "no output"


def check_slurm(grid: Grid) -> list[Problem]:
    """SLURM answers; the partition, the request and the account exist (module docstring)."""
    from cluster_fl.sweep import status as status_mod
    from cluster_fl.sweep.grid import check_resources

    r = grid.resources
    answer = _slurm_run(["sinfo", "-h", "-o", "%P"])
    if isinstance(answer, str):
        return [Problem("grid", "--cluster slurm", answer)]
    if answer.returncode != 0:
        return [Problem("grid", "--cluster slurm", "SLURM does not answer: "
                        + _first_error(answer.stderr or answer.stdout))]
    partitions = [p.strip() for p in answer.stdout.split() if p.strip()]
    names = [p.rstrip("*") for p in partitions]
    if r.partition is not None and r.partition not in names:
        return [Problem("grid", "resources.partition", f"no partition {r.partition!r} "
                        f"(sinfo lists {', '.join(partitions) or 'none'})")]
    if r.partition is None and not any(p.endswith("*") for p in partitions):
        return [Problem("grid", "resources.partition", "SLURM has no default partition; name "
                        f"one of {', '.join(names)}")]
    problems = []
    try:
        check_resources(grid)
    except UserError as exc:  # "resources.KEY=VALUE asks for ..." or "resources.KEY: ..."
        key, _, message = str(exc).partition(" ")
        problems.append(Problem("grid", key.rstrip(":"), message))
    if status_mod.slurm_nodes(r.partition) is None:
        problems.append(Problem("grid", "--cluster slurm", "sinfo cannot list the nodes"))
    if problems:
        return problems
    refused = _test_only(sbatch_flags(grid))
    if refused is not None and refused[0] == "":
        return [Problem("grid", "--cluster slurm", refused[1])]
    if refused is not None:
        low = refused[1].lower()
        key = ("resources.account" if "account" in low else "resources.qos" if "qos" in low
               else "resources.partition" if "partition" in low else "resources")
        return [Problem("grid", key, f"sbatch --test-only refuses the request: {refused[1]}")]
    return []


def check_features_request(grid: Grid) -> list[Problem]:
    """The features array's request (the grid's ``features`` section), which ``grid`` submits
    first when a store is not full: refused by ``sbatch --test-only`` -> one line naming it."""
    refused = _test_only(request_flags(grid.features, nodes=1, tasks_per_node=1))
    if refused is not None and refused[0] == "":
        return [Problem("grid", "--cluster slurm", refused[1])]
    if refused is not None:
        return [Problem("grid", "features", "sbatch --test-only refuses the features job's "
                        f"request: {refused[1]}")]
    return []


def _test_only(flags: list[str]) -> tuple[str, str] | None:
    """None when ``sbatch --test-only`` accepts the request; else ("", why sbatch could not be
    asked) or ("refused", sbatch's own error line)."""
    test = _slurm_run(["sbatch", "--test-only", *flags, "--wrap", "true"])
    if isinstance(test, str):
        return "", test
    if test.returncode != 0:
        return "refused", _first_error(test.stderr or test.stdout)
    return None


def sbatch_flags(grid: Grid) -> list[str]:
    """The request of one task as ``sbatch`` options (what submitit asks for)."""
    r = grid.resources
    return request_flags(r, nodes=r.nodes, tasks_per_node=r.tasks_per_node,
                         gpus_per_node=r.gpus_per_task * r.tasks_per_node)


def request_flags(r: Any, nodes: int, tasks_per_node: int, gpus_per_node: int = 0) -> list[str]:
    """``sbatch`` options of a request: ``r`` has ``cpus_per_task``, ``time_min``, ``mem_gb``
    and the scheduler keys (``partition``, ``account``, ``qos``, ``constraint``)."""
    flags = [f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
             f"--cpus-per-task={r.cpus_per_task}", f"--time={r.time_min}"]
    if gpus_per_node:
        flags.append(f"--gpus-per-node={gpus_per_node}")
    if r.mem_gb is not None:
        flags.append(f"--mem={int(math.ceil(r.mem_gb * 1024))}M")
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(r, key):
            flags.append(f"--{key}={getattr(r, key)}")
    return flags


# --------------------------------------------------------------------------- the whole check

def preflight(grid: Grid, specs: Sequence[RunSpec], cluster: str, *, inputs: bool = True,
              problems: Iterable[Problem] = ()) -> None:
    """Raise :class:`PreflightFailed` with every problem of the grid (``problems``: those found
    while expanding it); return quietly when the runs can be queued."""
    found = list(problems)
    if inputs:
        found += check_inputs(specs)
    if cluster == "slurm" and specs:
        found += check_slurm(grid)
        if not found and stores_to_fill(specs):  # the features job goes first: it must fit too
            found += check_features_request(grid)
    if found:
        raise PreflightFailed(found)


# --------------------------------------------------------------------------- dry-run estimates

# Sustained training throughput assumed for the round-time estimate (a stated estimate, not a
# measurement): a bf16 step on an A100/H100-class GPU at ~30% of its dense peak; per CPU core
# an fp32 step of this project's size measured ~20 GFLOP/s on the 2 AVX-512 cores of
# results/LOG.md.
FLOPS_PER_GPU = 100e12
FLOPS_PER_CPU = 20e9


def job_lines(grid: Grid, spec: RunSpec) -> list[str]:
    """What ``--dry-run`` prints under a job: its resources, the feature store, and ``plan``'s
    memory per GPU and round-time estimate (cached per distinct model and workload)."""
    r = grid.resources
    res = (f"  resources: {r.nodes} node(s) x {r.tasks_per_node} task(s), {r.gpus_per_task} "
           f"GPU(s) and {r.cpus_per_task} CPU(s) per task, "
           f"{'%g GB' % r.mem_gb if r.mem_gb is not None else 'default memory'}, "
           f"{r.time_min} min" + (f", partition {r.partition}" if r.partition else "")
           + (f", account {r.account}" if r.account else ""))
    lines = [res, "  " + features_line(spec.config)]
    try:
        lines.append("  " + estimate_line(grid, spec.config))
    except (UserError, OSError, ValueError, RuntimeError) as exc:
        lines.append(f"  estimate: unavailable ({short_reason(exc)})")
    return lines


def estimate_line(grid: Grid, cfg: Config) -> str:
    from cluster_fl.config import to_dict

    r = grid.resources
    key = repr((to_dict(cfg)["model"], cfg.fl.batch_size, r.world_size, r.gpus_per_task,
                r.gpu_memory_gb, r.cpus_per_task))
    if key not in _ESTIMATES:
        _ESTIMATES[key] = _memory_and_flops(grid, cfg)
    memory, flops_per_utt = _ESTIMATES[key]
    utts = _utterances_per_round(cfg)
    gpus = r.world_size * max(r.gpus_per_task, 0)
    lanes = max(1, r.world_size // cfg.model.shard_group_size)
    rate = FLOPS_PER_GPU * gpus if gpus else FLOPS_PER_CPU * r.cpus_per_task * r.world_size
    if utts is None:
        time_part = "round time: unknown (corpus unreadable)"
    else:
        seconds = utts * flops_per_utt / rate
        time_part = (f"round ~{_duration(seconds)} ({utts:,.0f} utterance-steps over {lanes} "
                     f"lane(s), ~{flops_per_utt / 1e12:.2f} TFLOP each, assumed "
                     f"{(FLOPS_PER_GPU if gpus else FLOPS_PER_CPU) / 1e12:g} TFLOP/s per "
                     f"{'GPU' if gpus else 'core'})")
    return f"estimate: {memory}; {time_part}"


_ESTIMATES: dict[str, tuple[str, float]] = {}


def _memory_and_flops(grid: Grid, cfg: Config) -> tuple[str, float]:
    """``plan``'s per-GPU total at the config's lane size, and the training FLOPs of one
    15-s utterance: 6 x trainable-path parameters x tokens (forward, backward through the
    activations, LoRA's small weight gradients) -- 2 x frozen forward + 2 x frozen backward."""
    from cluster_fl.sizing.plan import GIB, plan

    r = grid.resources
    gpus = r.world_size * r.gpus_per_task
    device = "cuda" if gpus else "cpu"
    result = plan(cfg, max(gpus, r.world_size), r.gpu_memory_gb or 80.0, device=device)
    rows = {row["group_size"]: row for row in result["rows"]}
    row = rows.get(cfg.model.shard_group_size, result["rows"][0])
    total = row[result["uses"]]["total_bytes"]
    where = "GPU" if gpus else "rank (host)"
    memory = (f"{total / GIB:.1f} GiB per {where} at G={row['group_size']} "
              f"({result['uses']}, {result['dtype']})")
    if gpus and r.gpu_memory_gb:
        memory += " fits" if total <= r.gpu_memory_gb * GIB else " does NOT fit"
    w, mdl = result["workload"], result["model"]
    tokens_per_utt = (w["encoder_tokens"] + w["decoder_tokens"]) / max(w["batch_size"], 1)
    params = mdl["frozen_params"] + mdl["trainable_params"]
    # encoder and decoder tokens pass through about half the parameters each
    return memory, 6.0 * params / 2 * tokens_per_utt


def _utterances_per_round(cfg: Config) -> float | None:
    """Utterance-steps of one round: clients_per_round x (local_epochs x a client's mean
    utterances, or max_local_steps x batch)."""
    counts = _client_counts(str(Path(cfg.data.corpus).expanduser()), tuple(cfg.data.languages),
                            cfg.data.client_split)
    if counts is None:
        return None
    speakers, rows = counts
    per_client = rows / max(speakers, 1)
    if cfg.data.max_utterances_per_client:
        per_client = min(per_client, cfg.data.max_utterances_per_client)
    steps = cfg.fl.local_epochs * math.ceil(per_client / cfg.fl.batch_size)
    if cfg.fl.max_local_steps:
        steps = min(steps, cfg.fl.max_local_steps)
    return cfg.fl.clients_per_round * steps * min(cfg.fl.batch_size, per_client)


@functools.lru_cache(maxsize=16)
def _client_counts(root: str, languages: tuple[str, ...], split: str) -> tuple[int, int] | None:
    """(speakers, utterances) of a split, from the speaker column only."""
    import pyarrow.parquet as pq

    from cluster_fl.data.mls import find_shards

    speakers: set[tuple[str, str]] = set()
    rows = 0
    try:
        for shard in find_shards(root, list(languages), [split]):
            pf = pq.ParquetFile(shard.path)
            column = next((c for c in ("speaker", "speaker_id") if c in pf.schema_arrow.names),
                          None)
            if column is None:
                return None
            values = pf.read(columns=[column]).column(column).to_pylist()
            rows += len(values)
            speakers.update((shard.language, str(v)) for v in values)
    except (UserError, OSError, ValueError):
        return None
    return len(speakers), rows


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


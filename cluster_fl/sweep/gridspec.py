"""Grid files: parse a grid YAML and expand it into one :class:`RunSpec` (a resolved config) per
cell x seed.

A grid names an experiment, a results root, an optional base preset, dotted-key overrides shared by
every cell (``set``), named axes whose entries carry a preset and/or overrides, cells to ``exclude``,
the ``seeds`` and the per-task ``resources``. See ``configs/grids/paper.yaml`` for the documented
format. Every run gets ``run.run_id = <cell>__s<seed>``, so its folder is known before it starts and
``status``/``grid`` can decide what is missing without asking the scheduler.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from cluster_fl.config import SECTIONS, Config, ConfigError, load_config, override, yaml_load
from cluster_fl.errors import UserError
from cluster_fl.sweep.features_job import FeaturesResources, features_resources

GRID_KEYS = {"experiment", "out", "base", "set", "axes", "exclude", "seeds", "resources",
             "features"}
RESOURCE_KEYS = {
    "nodes", "tasks_per_node", "gpus_per_task", "cpus_per_task", "mem_gb", "time_min",
    "partition", "account", "qos", "constraint", "array_parallelism", "signal_delay_s", "setup",
    "runs_per_gpu", "gpu_memory_gb",
}


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What one task (one cell x seed) asks the scheduler for."""

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_task: int = 0
    cpus_per_task: int = 1
    mem_gb: float | None = None
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    array_parallelism: int = 64
    signal_delay_s: int = 120
    setup: tuple[str, ...] = ()
    runs_per_gpu: int = 1
    """Runs side by side in one task, on each of its GPUs (on CPU: sharing its CPUs); each run
    one process (``cluster_fl.sweep.pack``). Memory is checked with ``plan`` first."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU (e.g. 80, 141): what ``runs_per_gpu`` runs must fit (``plan``)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "tasks_per_node", "cpus_per_task", "time_min", "array_parallelism",
                     "signal_delay_s", "runs_per_gpu"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"resources.{name}", f"got {value!r}; must be an integer >= 1")
        if not isinstance(self.gpus_per_task, int) or self.gpus_per_task < 0:
            raise ConfigError("resources.gpus_per_task", f"got {self.gpus_per_task!r}; must be >= 0")
        object.__setattr__(self, "setup", tuple(self.setup))
        if self.runs_per_gpu > 1 and self.nodes * self.tasks_per_node > 1:
            raise ConfigError("resources.runs_per_gpu", f"got {self.runs_per_gpu} with "
                              f"{self.nodes} node(s) x {self.tasks_per_node} task(s) a run: "
                              "packed runs are one process each (nodes: 1, tasks_per_node: 1)")
        if self.gpu_memory_gb is not None and not (
                isinstance(self.gpu_memory_gb, (int, float)) and self.gpu_memory_gb > 0):
            raise ConfigError("resources.gpu_memory_gb", f"got {self.gpu_memory_gb!r}; must be "
                              "a number of GiB > 0")

    @property
    def world_size(self) -> int:
        """Ranks of one run: one rank per task."""
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class RunSpec:
    """One task of a grid: its cell, seed, the dotted overrides that made it, and its config."""

    cell: str
    axes: Mapping[str, str]
    seed: int
    overrides: Mapping[str, Any]
    config: Config

    @property
    def run_id(self) -> str:
        return str(self.config.run.run_id)


@dataclass(frozen=True)
class Grid:
    """A parsed grid file."""

    path: Path
    experiment: str
    out: str
    base: Path | None
    overrides: Mapping[str, Any]
    axes: Mapping[str, tuple[Mapping[str, Any], ...]]
    exclude: tuple[Mapping[str, str], ...]
    seeds: tuple[int, ...]
    resources: Resources = field(default_factory=Resources)
    features: FeaturesResources = field(default_factory=FeaturesResources)
    """The features array job's CPU resources (``features`` section; sweep/features_job.py)."""

    @property
    def root(self) -> Path:
        """``<out>/<experiment>``: the folder holding every run folder of this grid."""
        return Path(self.out).expanduser() / self.experiment


def flatten(tree: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``{section: {key: v}}`` (a preset) or ``{"section.key": v}`` -> dotted overrides."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if key in SECTIONS and isinstance(value, Mapping):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(key, str) and key.count(".") == 1:
            flat[key] = value
        else:
            raise ConfigError(where, f"'{key}' is neither a config section nor a section.key")
    return flat


def _yaml_file(path: Path, key: str) -> Any:
    """A grid or preset file's YAML as configs read it (``1e-5`` is a number); a syntax error is
    one line naming the file."""
    try:
        return yaml_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{path} is not valid YAML ({exc.__class__.__name__})") from None


def _read_preset(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.expanduser().resolve()
    if path in seen:
        raise ConfigError("preset", f"circular inheritance through {path}")
    if not path.is_file():
        raise ConfigError("preset", f"file not found: {path}")
    raw = _yaml_file(path, "preset")
    bases = raw.pop("base", None)
    merged: dict[str, Any] = {}
    for b in [bases] if isinstance(bases, str) else (bases or []):
        merged.update(_read_preset(path.parent / b, seen + (path,)))
    merged.update(flatten(raw, str(path)))
    return merged


def load_grid(path: str | Path, out: str | None = None) -> Grid:
    """Parse and validate a grid file (``out`` overrides the grid's results root)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ConfigError("GRID", f"file not found: {path}")
    raw = _yaml_file(path, "GRID")
    if not isinstance(raw, dict):
        raise ConfigError("GRID", f"{path} must hold a mapping")
    unknown = set(raw) - GRID_KEYS
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"unknown grid key; allowed: {', '.join(sorted(GRID_KEYS))}")
    axes_raw = raw.get("axes") or {}
    if not isinstance(axes_raw, dict):
        raise ConfigError("axes", "must map axis names to lists of {name, preset?, set?}")
    axes: dict[str, tuple[dict[str, Any], ...]] = {}
    for axis, entries in axes_raw.items():
        if not entries or not isinstance(entries, list):
            raise ConfigError(f"axes.{axis}", "must be a non-empty list")
        parsed = []
        for i, entry in enumerate(entries):
            key = f"axes.{axis}[{i}]"
            if not isinstance(entry, dict) or "name" not in entry:
                raise ConfigError(key, "needs a name")
            extra = set(entry) - {"name", "preset", "set"}
            if extra:
                raise ConfigError(key, f"unknown keys {sorted(extra)}; allowed: name, preset, set")
            changes: dict[str, Any] = {}
            if entry.get("preset"):
                changes.update(_read_preset(path.parent / entry["preset"]))
            changes.update(flatten(entry.get("set") or {}, key + ".set"))
            parsed.append({"name": str(entry["name"]), "changes": changes})
        names = [e["name"] for e in parsed]
        if len(set(names)) != len(names):
            raise ConfigError(f"axes.{axis}", f"names must be unique, got {names}")
        axes[str(axis)] = tuple(parsed)
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError("seeds", f"got {seeds!r}; must be a non-empty list of integers")
    res_raw = raw.get("resources") or {}
    bad = set(res_raw) - RESOURCE_KEYS
    if bad:
        raise ConfigError(f"resources.{sorted(bad)[0]}",
                          f"unknown; allowed: {', '.join(sorted(RESOURCE_KEYS))}")
    experiment = str(raw.get("experiment") or path.stem)
    return Grid(
        path=path,
        experiment=experiment,
        out=str(out if out is not None else raw.get("out", "results")),
        base=(path.parent / raw["base"]).resolve() if raw.get("base") else None,
        overrides=flatten(raw.get("set") or {}, "set"),
        axes=axes,
        exclude=tuple(dict(e) for e in raw.get("exclude") or ()),
        seeds=tuple(seeds),
        resources=Resources(**{k: v for k, v in res_raw.items() if v is not None}),
        features=features_resources(raw.get("features")),
    )


def cell_name(choice: Mapping[str, str]) -> str:
    """Cell id from its axis values, e.g. ``whisper-tinyllama__unfrozen__alpha-split``."""
    return "__".join(choice.values()) if choice else "base"


def expand(grid: Grid, extra: Mapping[str, Any] | None = None,
           errors: Callable[[str, UserError], None] | None = None) -> list[RunSpec]:
    """Every cell x seed of a grid, each with its validated config (``extra`` overrides last).
    An invalid cell raises, naming it; with ``errors``, each invalid cell is handed to it once
    (cell, error) and left out, so pre-flight can report every one."""
    from cluster_fl.models.registry import resolve_shapes

    base = load_config(grid.base) if grid.base else Config()
    names = list(grid.axes)
    specs: list[RunSpec] = []
    reported: set[str] = set()
    for combo in itertools.product(*(grid.axes[a] for a in names)):
        choice = {a: e["name"] for a, e in zip(names, combo)}
        if any(all(choice.get(k) == v for k, v in ex.items()) for ex in grid.exclude):
            continue
        cell = cell_name(choice)
        for seed in grid.seeds:
            changes: dict[str, Any] = dict(grid.overrides)
            for entry in combo:
                changes.update(entry["changes"])
            changes.update(extra or {})
            # secure mode refuses a seed: grid seeds are then replicate labels (run folders
            # <cell>__s<k>), each run drawing its randomness from the OS
            secure = changes.get("privacy.secure_mode", base.privacy.secure_mode) is True
            changes.update({"run.seed": None if secure else seed, "run.experiment": grid.experiment,
                            "run.out": grid.out, "run.run_id": f"{cell}__s{seed}"})
            try:
                cfg = resolve_shapes(override(base, changes))  # data.n_mels: the model's
            except ConfigError as exc:
                if errors is None:
                    raise ConfigError(exc.key, f"in cell {cell}: {exc}") from None
                if cell not in reported:
                    errors(cell, exc)
                    reported.add(cell)
                continue
            except UserError as exc:  # e.g. an unreadable config.json of a checkpoint
                if errors is None:
                    raise
                if cell not in reported:
                    errors(cell, exc)
                    reported.add(cell)
                continue
            specs.append(RunSpec(cell=cell, axes=choice, seed=seed, overrides=changes, config=cfg))
    return specs


def run_folder(cfg: Config) -> Path:
    """The run folder of a config: the engine's ``run_dir`` when available, else the documented
    ``<run.out>/<run.experiment>/<run.run_id>``."""
    try:
        from cluster_fl.engine.rundir import run_dir
    except ImportError:
        run_dir = None
    if run_dir is not None:
        return Path(run_dir(cfg))
    return Path(cfg.run.out).expanduser() / cfg.run.experiment / str(cfg.run.run_id)

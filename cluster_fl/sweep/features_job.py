"""The features job a SLURM grid submits before its training runs, when the store is not full.

A grid's cells read one or more features stores (one per distinct data setting: corpus, cache,
mel bins, languages, splits). When any of them lacks a part, ``grid --cluster slurm`` submits an
array job of ``features.tasks`` CPU tasks -- task i runs ``cluster-fl features`` part i/n of every
store (:func:`cluster_fl.data.store.build_features`) -- and the training array waits for it
(``--dependency=afterok``): no GPU idles while features are computed, and a failed features job
holds the training jobs back instead of letting each compute its own.

Its resources are the grid file's ``features`` section (CPU only, its own partition)::

    features: {tasks: 16, cpus_per_task: 4, mem_gb: 16, time_min: 240, partition: cpu}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

FEATURE_KEYS = ("tasks", "cpus_per_task", "mem_gb", "time_min", "partition", "account", "qos",
                "constraint", "setup")


@dataclass(frozen=True)
class FeaturesResources:
    """What each task of the features array asks for (the grid's ``features`` section)."""

    tasks: int = 8
    cpus_per_task: int = 4
    mem_gb: float = 16
    time_min: int = 240
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from cluster_fl.config import ConfigError

        for name in ("tasks", "cpus_per_task", "time_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"features.{name}", f"got {value!r}; must be an integer >= 1")
        object.__setattr__(self, "setup", tuple(self.setup))


def features_resources(raw: Mapping[str, Any] | None) -> FeaturesResources:
    """The grid file's ``features`` section, checked (unknown keys named)."""
    from cluster_fl.config import ConfigError

    raw = raw or {}
    bad = set(raw) - set(FEATURE_KEYS)
    if bad:
        raise ConfigError(f"features.{sorted(bad)[0]}", f"unknown; allowed: {', '.join(FEATURE_KEYS)}")
    return FeaturesResources(**{k: v for k, v in raw.items() if v is not None})


def stores_to_fill(specs: Sequence[Any]) -> list[Any]:
    """The distinct data settings of ``specs`` whose store lacks a part (or cannot be checked
    from here: the corpus is not readable on the submitting host)."""
    from cluster_fl.data.store import config_missing

    # -1 (the corpus is not readable from here) counts as lacking: the job will see
    return [data for data in dict.fromkeys(spec.config.data for spec in specs)
            if config_missing(data) != 0]


class FeaturesTask:
    """One task of the features array: part ``part`` of ``parts`` of every store."""

    def __init__(self, data: Sequence[Mapping[str, Any]], part: int, parts: int):
        self.data, self.part, self.parts = [dict(d) for d in data], part, parts

    def __call__(self) -> int:
        from cluster_fl.config import DataConfig
        from cluster_fl.data.store import build_features

        for d in self.data:
            done = build_features(DataConfig(**d), self.part, self.parts,
                                  log=lambda msg: print(f"features: {msg}", flush=True))
            print(f"features: part {self.part}/{self.parts}: {done['computed']} part(s) computed "
                  f"-> {done['store']}", flush=True)
        return 0


def submit_features(grid: Any, specs: Sequence[Any], make: Any) -> str | None:
    """Submit the features array when a store of ``specs`` is not full; its job id, else None.
    ``make(params)``: a submitit executor with ``params`` (the grid's, so tests can fake it)."""
    data = stores_to_fill(specs)
    if not data:
        return None
    r: FeaturesResources = grid.features
    params: dict[str, Any] = {"name": f"cfl-{grid.experiment}-features", "timeout_min": r.time_min,
                              "nodes": 1, "tasks_per_node": 1, "cpus_per_task": r.cpus_per_task,
                              "mem_gb": r.mem_gb, "slurm_array_parallelism": r.tasks}
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(r, key):
            params[f"slurm_{key}"] = getattr(r, key)
    if r.setup:
        params["slurm_setup"] = list(r.setup)
    executor = make(params)
    dicts = [asdict(d) for d in data]
    jobs = executor.submit_array([FeaturesTask(dicts, i, r.tasks) for i in range(r.tasks)])
    return str(jobs[0].job_id).split("_")[0]  # the array's id: afterok waits for every task

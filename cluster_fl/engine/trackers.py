"""Experiment trackers (``run.report_to``): TensorBoard, Weights & Biases, MLflow.

What they receive is what the run folder releases, nothing more (as HF Trainer's ``report_to``,
but only released values): the resolved config once, each round's metrics row (ε so far,
thresholds, the noised -- or, in a void or non-private run, exact -- diagnostics, the test WER
of an evaluated round) and the final evaluation. Never the operator log, never a wall time the
run chose to send: TensorBoard events and MLflow metrics are stamped with the round number in
place of the time of day. W&B stamps every logged step with its own clock (``_timestamp``,
``_runtime``), which cannot be turned off; where a round's duration must stay private, use
TensorBoard or MLflow.

Each tracker writes under ``<out>/<experiment>/.trackers/``: TensorBoard to
``tensorboard/<run_id>`` (``tensorboard --logdir .../.trackers/tensorboard`` compares runs),
W&B to ``wandb/`` (offline unless ``WANDB_MODE`` says otherwise; project = experiment, name =
run id), MLflow to ``mlflow.db`` (:func:`mlflow_uri`) unless ``MLFLOW_TRACKING_URI`` is set.
Only rank 0 reports.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from cluster_fl.errors import UserError

TRACKER_DIR = ".trackers"
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def released_values(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric values of a released row, by name (``prefix`` + key); text, flags
    and the round number itself are left out."""
    out = {}
    for key, value in row.items():
        if key in ("round", "run_id") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[prefix + key] = float(value)
    return out


def flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """``{"privacy.clip_norm": 1.0, ...}`` from a config's nested dicts (lists as JSON text)."""
    out: dict[str, Any] = {}
    for section, keys in config.items():
        for key, value in (keys or {}).items():
            out[f"{section}.{key}"] = (json.dumps(value) if isinstance(value, (list, tuple, dict))
                                       else value)
    return out


class _TensorBoard:
    def __init__(self, root: Path, run: str, config: Mapping[str, Any]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(root / "tensorboard" / run))
        text = "\n".join(f"    {k}: {v}" for k, v in flatten(config).items())
        self.writer.add_text("config", text, global_step=0, walltime=0.0)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():  # the round, not the time of day, stamps each event
            self.writer.add_scalar(name, value, global_step=step, walltime=float(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, root: Path, run: str, config: Mapping[str, Any], experiment: str):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb") from None
        (root / "wandb").mkdir(parents=True, exist_ok=True)
        mode: Any = os.environ.get("WANDB_MODE", "offline")  # never online unless asked
        self.run = wandb.init(project=experiment, name=run, id=_wandb_id(run), resume="allow",
                              dir=str(root), config=flatten(config),
                              mode=mode,
                              settings=wandb.Settings(console="off", x_disable_stats=True,
                                                      x_disable_meta=True))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, root: Path, run: str, config: Mapping[str, Any], experiment: str):
        try:
            import mlflow
        except ImportError:
            raise _missing("mlflow") from None
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(mlflow_uri(root))
        mlflow.set_experiment(experiment)
        self.active = mlflow.start_run(run_name=run)
        mlflow.log_params({k: str(v)[:500] for k, v in flatten(config).items()})

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():  # the round stamps the metric, not the clock
            self.mlflow.log_metric(name.replace("/", "."), value, step=step, timestamp=step)

    def close(self) -> None:
        self.mlflow.end_run()


def mlflow_uri(root: Path) -> str:
    """Where MLflow records a run when ``MLFLOW_TRACKING_URI`` is not set: a SQLite database
    under ``root`` (``mlflow.db``), or, where SQLAlchemy is missing (``mlflow-skinny``), its
    file store ``root/mlruns`` (which MLflow 3 serves only when asked to)."""
    try:
        import sqlalchemy  # noqa: F401  (MLflow's database stores need it)
    except ImportError:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (Path(root) / "mlruns").resolve().as_uri()
    return f"sqlite:///{(Path(root) / 'mlflow.db').resolve()}"


def _wandb_id(run: str) -> str:
    import hashlib

    return hashlib.sha1(run.encode()).hexdigest()[:16]  # a resumed run continues its W&B run


def _missing(name: str) -> UserError:
    return UserError(f"run.report_to names {name}, which is not installed: pip install "
                     f"'cluster_fl[trackers]' (or pip install {_PACKAGES[name]}), or drop it "
                     "from run.report_to")


class Trackers:
    """The run's trackers (none when ``names`` is empty or on ranks other than 0)."""

    def __init__(self, names: Sequence[str], folder: Path, config: Mapping[str, Any],
                 enabled: bool = True):
        self.backends: list[Any] = []
        if not enabled or not names:
            return
        folder = Path(folder)
        root = folder.parent / TRACKER_DIR
        root.mkdir(parents=True, exist_ok=True)
        run, experiment = folder.name, folder.parent.name
        for name in names:
            if name == "tensorboard":
                self.backends.append(_TensorBoard(root, run, config))
            elif name == "wandb":
                self.backends.append(_WandB(root, run, config, experiment))
            elif name == "mlflow":
                self.backends.append(_MLflow(root, run, config, experiment))

    def log_round(self, round_: int, row: Mapping[str, Any]) -> None:
        """A round's released row (``rounds.parquet``'s row)."""
        values = released_values(row, "round/")
        for backend in self.backends:
            backend.log(round_, values)

    def log_final(self, rounds: int, final: Mapping[str, Any]) -> None:
        """The final evaluation and ε (``final.parquet``'s numeric values)."""
        values = released_values({k: v for k, v in final.items() if k != "wall_s"}, "final/")
        for backend in self.backends:
            backend.log(rounds, values)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []

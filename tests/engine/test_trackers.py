"""``run.report_to``: TensorBoard, W&B (offline) and MLflow receive the config, each round's
released row and the final evaluation -- read back from what each wrote, and equal to the run
folder's own rows; nothing of the operator log reaches them, and TensorBoard's events carry the
round, not the time of day. Each test skips when its package is not installed (``.ci/run``
installs the ``trackers`` extra before running them)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from engine_helpers import tiny_config

from cluster_fl.config import load_config
from cluster_fl.engine.rundir import run_id
from cluster_fl.engine.train import run_training
from cluster_fl.engine.trackers import mlflow_uri, released_values
from cluster_fl.errors import UserError

OPERATOR_FACTS = ("cohort", "trained", "nonfinite", "skipped", "wall_s", "t_clients", "t_noise",
                  "t_sum", "lanes")


@pytest.fixture(scope="module")
def tracked_run(tiny_corpus, tmp_path_factory):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("tracked")
    folder = run_training(tiny_config(tiny_corpus, out, "eval.every=1",
                                      "run.report_to=[tensorboard,wandb]"))
    return {"folder": folder, "rounds": pq.read_table(folder / "rounds.parquet").to_pylist(),
            "final": pq.read_table(folder / "final.parquet").to_pylist()[0]}


def test_tensorboard_holds_each_rounds_released_values_stamped_with_the_round(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tracked_run["folder"]
    acc = EventAccumulator(str(folder.parent / ".trackers" / "tensorboard" / folder.name),
                           size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    eps = acc.Scalars("round/epsilon")
    assert [e.step for e in eps] == [1, 2]
    assert [e.value for e in eps] == pytest.approx([r["epsilon"] for r in tracked_run["rounds"]])
    assert [e.wall_time for e in eps] == [1.0, 2.0]  # the round, never the time of day
    assert [(e.step, e.value) for e in acc.Scalars("round/wer")] == \
        [(1, pytest.approx(tracked_run["rounds"][0]["wer"]))]  # evaluated round 1 (every=1 < 2)
    assert acc.Scalars("final/wer")[0].value == pytest.approx(tracked_run["final"]["wer"])
    assert "round/clip_rate" in tags and "round/diag_noise_std" in tags  # noised diagnostics
    assert not [t for t in tags if t.split("/", 1)[1] in OPERATOR_FACTS]
    assert "config" in "".join(acc.Tags()["tensors"])


def _wandb_records(path):
    """The protobuf records of an offline W&B run file: a 7-byte header, then LevelDB's log
    format (32 KiB blocks of records: crc, length, type full/first/middle/last)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, out, part = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
    return out


def test_wandb_offline_holds_the_config_and_the_released_values(tracked_run):
    folder = tracked_run["folder"]
    runs = list((folder.parent / ".trackers" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    records = _wandb_records(runs[0])
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2]  # round 2 and the final evaluation share a step
    assert [h["round/epsilon"] for h in history] == pytest.approx(
        [r["epsilon"] for r in tracked_run["rounds"]])
    assert history[0]["round/wer"] == pytest.approx(tracked_run["rounds"][0]["wer"])
    assert history[1]["final/wer"] == pytest.approx(tracked_run["final"]["wer"])
    assert not [k for h in history for k in h if k.split("/", 1)[-1] in OPERATOR_FACTS]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["privacy.clipping"] == "alpha-split"
    assert config["fl.rounds"] == 2


def test_mlflow_holds_the_released_values_where_it_is_installed(tiny_corpus, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    folder = run_training(tiny_config(tiny_corpus, tmp_path, "run.report_to=mlflow"))
    client = MlflowClient(tracking_uri=mlflow_uri(folder.parent / ".trackers"))
    run = client.search_runs([client.get_experiment_by_name(folder.parent.name).experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "round.epsilon")
    rows = pq.read_table(folder / "rounds.parquet").to_pylist()
    assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r["epsilon"]))
                                                    for r in rows]
    assert run.data.params["privacy.clipping"] == "alpha-split"


def test_report_to_is_checked_and_does_not_change_the_run_id(tmp_path):
    from cluster_fl.models.registry import resolve_shapes

    base = resolve_shapes(load_config(None, []))
    assert base.run.report_to == ()
    tracked = resolve_shapes(load_config(None, ["run.report_to=[tensorboard,wandb]"]))
    assert run_id(tracked) == run_id(base)
    assert load_config(None, ["run.report_to=none"]).run.report_to == ()
    with pytest.raises(UserError, match="run.report_to"):
        load_config(None, ["run.report_to=[tensorbord]"])


def test_only_finite_numbers_of_a_released_row_are_reported():
    row = {"round": 3, "epsilon": 1.5, "loss": float("nan"), "diagnostics": "noised",
           "threshold/enc": 0.25, "flag": True}
    assert released_values(row, "round/") == {"round/epsilon": 1.5, "round/threshold/enc": 0.25}

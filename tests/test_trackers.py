"""Experiment trackers (issue 25, part 4): TensorBoard read back from its event file; W&B in
offline mode and MLflow's SQLite store read back from their own files."""

from __future__ import annotations

import json

import pytest

from fedslice.api import run_experiment
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.trackers import metric_name, scalars


def _run(tiny_cfg_dict, report_to, **env):
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["output"]["report_to"] = report_to
    return run_experiment(validate_config(d))


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_file_holds_every_round(tiny_cfg_dict):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run(tiny_cfg_dict, ["tensorboard"])
    (events,) = (run / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    records = _records(run)
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "eval/accuracy", "eval/loss", "fl/bytes_up_mean"} <= tags
    for tag, key in (("eval/accuracy", "dev_accuracy"), ("train/loss", "train_loss")):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert got == [(r["round"], pytest.approx(r[key], rel=1e-6)) for r in records]
    summary = json.loads((run / "summary.json").read_text())
    assert acc.Scalars("summary/test_accuracy")[0].value == pytest.approx(summary["test_accuracy"])
    assert "federation.lr" in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_wandb_offline_and_mlflow_local_store(tiny_cfg_dict, monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = _run(tiny_cfg_dict, ["wandb", "mlflow"])
    records = _records(run)
    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("run-*.wandb"))  # the offline run file, for `wandb sync`
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fedslice")
    (found,) = client.search_runs([exp.experiment_id])
    assert found.info.status == "FINISHED" and found.data.params["federation.rounds"] == "2"
    hist = client.get_metric_history(found.info.run_id, "eval/accuracy")
    assert [(m.step, m.value) for m in hist] == [(r["round"], pytest.approx(r["dev_accuracy"])) for r in records]


def test_names_and_bad_input(tiny_cfg_dict):
    assert metric_name("dev_accuracy") == "eval/accuracy" and metric_name("bytes_up_mean") == "fl/bytes_up_mean"
    assert scalars({"round": 1, "train_loss": 0.5, "skipped": False, "clients": [1], "x": None,
                    "dev_loss": float("nan")}) == {"train/loss": 0.5}
    with pytest.raises(ConfigError, match="report_to"):
        validate_config({"output": {"report_to": ["comet"]}})

"""Experiment trackers (``output.report_to``): TensorBoard, Weights & Biases, MLflow.

As HF Trainer users expect: the resolved config as hyperparameters at the start, one scalar per
metric per round (step = round; names grouped ``train/``, ``eval/`` (dev), ``test/``, ``fl/``
(costs, selection)), the summary's numbers at the end. Where each writes:

* ``tensorboard``: event files in ``<run folder>/tensorboard`` (``tensorboard --logdir runs``);
* ``wandb``: a run in project ``$WANDB_PROJECT`` (default ``fedslice``), its files under the run
  folder; ``WANDB_MODE=offline`` (no account) keeps it local for ``wandb sync`` later;
* ``mlflow``: a run in experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``fedslice``) of the
  tracking server ``$MLFLOW_TRACKING_URI``, by default the SQLite store ``<output.dir>/mlflow.db``
  (``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db``).

The packages are optional (``pip install 'fedslice[trackers]'``); a tracker whose package is
missing is a ConfigError naming it before training starts.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fedslice.config import ExperimentConfig
from fedslice.errors import ConfigError


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def hyperparameters(cfg: ExperimentConfig) -> dict[str, Any]:
    """The resolved config, flat (``federation.lr``), values as scalars or strings."""
    return {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
            for k, v in _flat(cfg.model_dump(mode="json")).items() if v is not None}


def metric_name(key: str) -> str:
    for prefix, group in (("dev_", "eval/"), ("test_", "test/"), ("train_", "train/")):
        if key.startswith(prefix):
            return group + key[len(prefix):]
    return "fl/" + key


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The round record's single numbers (not the round, lists or per-client tables)."""
    out = {}
    for k, v in record.items():
        if k == "round" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[metric_name(k)] = float(v)
    return out


class Tracker:
    name = "tracker"
    package = ""

    def __init__(self, cfg: ExperimentConfig, folder: Path, run_name: str):
        self.cfg, self.folder, self.run_name = cfg, folder, run_name

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, summary: dict[str, float] | None) -> None:
        """Log the summary's numbers (None: the run failed) and close."""


class TensorBoard(Tracker):
    name, package = "tensorboard", "tensorboard"

    def __init__(self, cfg, folder, run_name):
        super().__init__(cfg, folder, run_name)
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))
        text = "\n".join(f"    {k} = {v}" for k, v in hyperparameters(cfg).items())
        self.writer.add_text("config", text)

    def log(self, step, values):
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self, summary):
        if summary:
            step = int(summary.get("rounds") or 0)
            for k, v in summary.items():
                self.writer.add_scalar(f"summary/{k}", v, step)
        self.writer.close()


class WandB(Tracker):
    name, package = "wandb", "wandb"

    def __init__(self, cfg, folder, run_name):
        super().__init__(cfg, folder, run_name)
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fedslice"), name=run_name,
                              config=hyperparameters(cfg), dir=str(folder), reinit="finish_previous")

    def log(self, step, values):
        self.run.log(values, step=step)

    def finish(self, summary):
        if summary:
            for k, v in summary.items():
                self.run.summary[k] = v
        self.run.finish(exit_code=0 if summary is not None else 1)


class MLflow(Tracker):
    name, package = "mlflow", "mlflow-skinny"

    def __init__(self, cfg, folder, run_name):
        super().__init__(cfg, folder, run_name)
        import mlflow
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            store = Path(cfg.output.dir).resolve()
            store.mkdir(parents=True, exist_ok=True)
            mlflow.set_tracking_uri(f"sqlite:///{store / 'mlflow.db'}")
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "fedslice"))
        self.run = mlflow.start_run(run_name=run_name)
        params = {k: str(v)[:6000] for k, v in hyperparameters(cfg).items()}
        mlflow.log_params(params)
        mlflow.set_tag("fedslice.run_folder", str(folder))

    def log(self, step, values):
        self.mlflow.log_metrics(values, step=step)

    def finish(self, summary):
        if summary:
            self.mlflow.log_metrics({f"summary/{k}": v for k, v in summary.items()})
        self.mlflow.end_run("FINISHED" if summary is not None else "FAILED")


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoard, WandB, MLflow)}


class Trackers:
    """The trackers of ``output.report_to`` for one run (none: every call does nothing)."""

    def __init__(self, cfg: ExperimentConfig, folder: Path, run_name: str):
        self.items: list[Tracker] = []
        for name in cfg.output.report_to:
            cls = TRACKERS[name]
            try:
                self.items.append(cls(cfg, Path(folder), run_name))
            except ImportError as e:
                self.finish(None)
                raise ConfigError(f"output.report_to: {name!r} needs the package {cls.package} "
                                  f"(pip install 'fedslice[trackers]'): {e}") from None

    def round(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        for t in self.items:
            t.log(int(record["round"]), values)

    def finish(self, summary: dict[str, Any] | None) -> None:
        numbers = None if summary is None else {k: float(v) for k, v in summary.items()
                                                 if isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and math.isfinite(v)}
        items, self.items = self.items, []
        for t in items:
            t.finish(numbers)

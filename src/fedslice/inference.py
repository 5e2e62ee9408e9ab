"""``fedslice predict`` and ``fedslice evaluate``: the trained model of a run folder on new data.

Both rebuild the model fedslice evaluated (:func:`fedslice.export.trained_model`: the base model
named in the run's config with its trained tensors; no training data needed) and read files
with the same loaders as training. ``predict`` writes one record per input row, in input order:
the row's columns plus ``prediction`` (the label's name, or its id when the labels have no
names; the generated text for generation) and, for classification, ``probabilities`` (by label).
``evaluate`` scores the model on another dataset with the task's metrics and writes
``eval-<name>.json`` into the run folder.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedslice.config import apply_overrides
from fedslice.experiment import validate_config
from fedslice.data.tables import drop_incomplete, read_table
from fedslice.errors import ConfigError, DataError
from fedslice.export import Rebuilt, TrainedRun, read_run, trained_model
from fedslice.models.arch import CLASSIFIER_HEADS
from fedslice.output import to_jsonable, write_json_atomic
from fedslice.tasks import make_task


def _task(run: TrainedRun, rebuilt: Rebuilt, cfg=None):
    task = make_task(cfg or run.cfg, rebuilt.loaded.arch)
    task.text_columns = run.info.get("text_columns")
    task.label_names = run.info.get("label_names")
    return task


@contextmanager
def _progress():
    """Bars on stderr when it is a terminal (stdout may carry the predictions)."""
    from fedslice import progress
    display = None
    if sys.stderr.isatty():
        from rich.console import Console
        display = progress.RichDisplay(0, "fedslice", console=Console(stderr=True))
    with progress.activate(display):
        yield


# --------------------------------------------------------------------------------------------
# predict
# --------------------------------------------------------------------------------------------

def predict(run_dir: str | Path, input_path: str | Path, output: str | Path | None = None, *,
            batch_size: int | None = None) -> list[dict[str, Any]]:
    """Predictions for every row of ``input_path`` (CSV/TSV/JSONL, read as the run's data);
    written to ``output`` (``.jsonl``, ``.csv`` or ``.tsv``) or, when None, to stdout as JSONL.
    Returns the records."""
    out_format = None if output is None else _out_format(Path(output))
    run = read_run(run_dir)
    d = run.cfg.data
    path = Path(input_path)
    if not path.is_file():
        raise DataError(f"--input {path}: no such file")
    table = read_table(path, header=d.header, columns=d.columns, quotes=d.quotes,
                       skip_bad_rows=d.bad_rows == "skip")
    rebuilt = trained_model(run)
    task = _task(run, rebuilt)
    need = task.input_columns()
    missing = [c for c in need if c not in table.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing} that the run reads (its "
                        f"{'prompt template' if run.cfg.task.prompt else 'text column(s)'}); "
                        f"columns found: {list(table.columns)}")
    table, _ = drop_incomplete(table, [(c, "the run's input columns") for c in need],
                               skip=d.bad_rows == "skip")
    columns = list(table.columns)
    rows = [dict(zip(columns, cells)) for cells in zip(*table.columns.values())]
    with _progress():
        preds = task.predict(rebuilt.model, rebuilt.loaded, rows, batch_size or
                             run.cfg.evaluation.batch_size, table.source)
    names = run.info.get("label_names")
    records = []
    for row, p in zip(rows, preds):
        rec = dict(row)
        if "probabilities" in p:
            label = p["prediction"]
            rec["prediction"] = names[label] if names else label
            rec["probabilities"] = ({n: float(x) for n, x in zip(names, p["probabilities"])}
                                    if names else [float(x) for x in p["probabilities"]])
        else:
            rec["prediction"] = p["prediction"]
        records.append(rec)
    _write_records(records, output, out_format)
    return records


def _out_format(path: Path) -> str:
    fmt = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"--output {path}: use a .jsonl, .csv or .tsv file")
    return fmt


def _write_records(records: list[dict[str, Any]], output, fmt: str | None) -> None:
    if output is None:
        for r in records:
            sys.stdout.write(json.dumps(to_jsonable(r), ensure_ascii=False) + "\n")
        return
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        if fmt == "jsonl":
            for r in records:
                f.write(json.dumps(to_jsonable(r), ensure_ascii=False) + "\n")
        else:
            fields = list(dict.fromkeys(k for r in records for k in r))
            w = csv.DictWriter(f, fields, delimiter="\t" if fmt == "tsv" else ",")
            w.writeheader()
            for r in records:
                w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v
                            for k, v in r.items()})
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# evaluate
# --------------------------------------------------------------------------------------------

def evaluate(run_dir: str | Path, data_path: str, overrides: list[str] | None = None, *,
             name: str | None = None, batch_size: int | None = None) -> tuple[Path, dict[str, Any]]:
    """The task's metrics of the run's trained model on every split of ``data_path`` (a file:
    all its rows; a folder: each of its train/dev/test files; nothing carved off), read with the
    run's ``data.*`` options changed by ``overrides`` (``data.header=false``, ...). Label ids
    are the run's (by name). Writes ``eval-<name>.json`` into the run folder."""
    run = read_run(run_dir)
    bad = [o for o in overrides or [] if not o.strip().startswith("data.")]
    if bad:
        raise ConfigError(f"evaluate: --set changes data.* options only, got {bad}")
    data = {**run.cfg.data.model_dump(mode="json"), "path": str(data_path)}
    if data.get("text_columns") is None and run.info.get("text_columns"):
        data["text_columns"] = run.info["text_columns"]  # the columns the run read
    names = run.info.get("label_names")
    if names and run.info["head"] in CLASSIFIER_HEADS and not data.get("labels"):
        data["labels"] = names  # the run's label ids
    given = apply_overrides({**run.cfg.model_dump(mode="json"), "data": data}, overrides or [])
    cfg = validate_config(given, "evaluate")
    rebuilt = trained_model(run)
    task = _task(run, rebuilt, cfg)
    raw = task.load_raw(carve_missing=False)
    encoded = task.encode(raw, rebuilt.loaded)
    bs = batch_size or cfg.evaluation.batch_size
    with _progress():
        metrics = {split: {k: v for k, v in task.evaluate(rebuilt.model, part, bs).items()}
                   for split, part in encoded.items()}
    if Path(str(data_path)).is_file() and cfg.data.split_column is None:
        metrics = {"all": metrics.pop("train")}  # one file: every row
        encoded = {"all": encoded["train"]}
    label = name or re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(str(data_path)).stem).strip(".-") or "data"
    result = {"data": str(data_path), "method": run.cfg.method.name, "task": task.kind,
              "primary_metric": task.primary_metric, "overrides": list(overrides or []),
              "examples": {s: len(p) for s, p in encoded.items()}, "metrics": metrics}
    if names:
        for m in metrics.values():
            if isinstance(m.get("per_class_accuracy"), list):
                m["per_class_accuracy"] = dict(zip(names, m["per_class_accuracy"]))
    if run.partial is None:
        path = write_json_atomic(run.path / f"eval-{label}.json", result)
    else:  # pragma: no cover - read_run refuses unfinished runs here
        path = run.path
    return path, result

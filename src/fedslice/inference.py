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
from fedslice.output import LABELS, to_jsonable, write_json_atomic
from fedslice.tasks import make_task


def _task(run: TrainedRun, rebuilt: Rebuilt, cfg=None):
    task = make_task(cfg or run.cfg, rebuilt.loaded.arch)
    task.text_columns = run.info.get("text_columns")
    task.label_names = run_labels(run)
    return task


def run_labels(run: TrainedRun) -> list[str] | None:
    """The class names the run was trained with, by id (its ``labels.json``), or None when its
    labels were plain ids."""
    file = run.path / LABELS
    if not file.is_file():
        return run.info.get("label_names")
    try:
        names = json.loads(file.read_text(encoding="utf-8"))["names"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{file} is damaged: it does not list the run's label names; restore "
                        "it from a copy") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DataError(f"{file} is damaged: its names are not a list of strings")
    return names


def _label_list(run: TrainedRun) -> list[str] | None:
    """The run's labels as ``data.labels`` reads them: its names, or its ids ``"0" .. "K-1"``
    (None for a task without classes)."""
    if run.info.get("head") not in CLASSIFIER_HEADS:
        return None
    names = run_labels(run)
    return names if names else [str(i) for i in range(int(run.info["num_labels"]))]


def _describe_labels(run: TrainedRun) -> str:
    names = run_labels(run)
    if names:
        return (f"names {', '.join(map(repr, names))} (or their ids 0 .. {len(names) - 1}; a "
                f"file's labels are all names or all ids)")
    return f"ids 0 .. {int(run.info['num_labels']) - 1} (no names)"


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
    if d.bad_rows != "skip":
        _check_filled(table, need)
    table, _ = drop_incomplete(table, [(c, "the run's input columns") for c in need],
                               skip=d.bad_rows == "skip")
    if not len(table):
        raise DataError(f"--input {path} has no rows to predict (only a header, or every row "
                        "skipped)")
    columns = list(table.columns)
    rows = [dict(zip(columns, cells)) for cells in zip(*table.columns.values())]
    with _progress():
        preds = task.predict(rebuilt.model, rebuilt.loaded, rows, batch_size or
                             run.cfg.evaluation.batch_size, table.source)
    names = run_labels(run)
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


def _check_filled(table, columns: list[str]) -> None:
    """Every row has text in every input column (predict writes one prediction per row)."""
    for name in columns:
        for i, value in enumerate(table.columns[name]):
            if value is None or (isinstance(value, str) and not value.strip()):
                what = "no field" if value is None else "an empty field"
                raise DataError(f"{table.where(i)}: row has {what} {name!r}: predict writes one "
                                "prediction per row; fill the field or remove the row")


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

def _load_raw(run: TrainedRun, task):
    """The evaluation data, its labels read as the run's: a label the run never saw is an error
    naming it and the run's labels."""
    try:
        return task.load_raw(carve_missing=False)
    except DataError as e:
        if "data.labels" not in str(e):
            raise
        msg = re.sub(r"data\.labels = \[.*?\]", "the run's labels", str(e)).replace(
            "data.labels", "the run's labels")
        raise DataError(f"{msg}: evaluate reads labels as the run {run.path} was trained: "
                        f"{_describe_labels(run)}") from None


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
    labels = _label_list(run)
    if labels is not None and any(o.strip().startswith("data.labels") for o in overrides or []):
        raise ConfigError(f"evaluate: the labels are the run's ({_describe_labels(run)}): "
                          "--set data.labels cannot change them")
    data["labels"] = labels  # the run's label ids, by name or id: never the file's own order
    given = apply_overrides({**run.cfg.model_dump(mode="json"), "data": data}, overrides or [])
    cfg = validate_config(given, "evaluate")
    rebuilt = trained_model(run)
    task = _task(run, rebuilt, cfg)
    raw = _load_raw(run, task)
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
    names = run_labels(run)
    if names:
        for m in metrics.values():
            if isinstance(m.get("per_class_accuracy"), list):
                m["per_class_accuracy"] = dict(zip(names, m["per_class_accuracy"]))
    if run.partial is None:
        path = write_json_atomic(run.path / f"eval-{label}.json", result)
    else:  # pragma: no cover - read_run refuses unfinished runs here
        path = run.path
    return path, result

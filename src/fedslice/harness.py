"""``fedslice evaluate RUN --harness TASKS``: a run's trained model scored by EleutherAI's
lm-evaluation-harness (``lm_eval``, the ``eval`` extra), through its Python API.

The model is the one fedslice evaluated (:func:`fedslice.export.trained_model`): over a plain
base the adapter is merged into it, which is exactly what ``fedslice export --format merged``
saves, so the scores equal ``lm_eval --model hf --model_args pretrained=<that folder>`` on the
same tasks, limit and shots; over a quantized base (``model.quantize``) the adapter stays applied
to the int8 base as trained. ``baseline``: the same tasks on the untrained model (the base model
as the run loaded it, quantized as trained), so the change training made is beside the score.

Tasks: lm_eval's own names (their data sets come from the hub, so they need it reachable), the
local tasks fedslice ships (:mod:`fedslice.harness_tasks`, e.g. ``arc_easy_local``), and those of
any ``include`` folder of task YAMLs. Results go to ``harness.json`` in the run folder (one entry
per task, a later evaluation of a task replacing the earlier one) and into ``report.html``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedslice.errors import ConfigError, FedsliceError
from fedslice.export import TrainedRun, read_run, trained_model
from fedslice.output import HARNESS, write_json_atomic

log = logging.getLogger(__name__)

_LM_HEADS = ("causal_lm", "seq2seq_lm")


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ConfigError(f"--harness needs lm-evaluation-harness ({e}): pip install "
                          "'fedslice[eval]'") from None
    return evaluator, TaskManager


def parse_tasks(spec: str | list[str]) -> list[str]:
    """``"a,b, c"`` (or a list of such) as task names, in order, without repeats."""
    parts = [spec] if isinstance(spec, str) else list(spec)
    names = [n.strip() for p in parts for n in p.split(",")]
    names = list(dict.fromkeys(n for n in names if n))
    if not names:
        raise ConfigError("--harness: name at least one task, e.g. --harness arc_easy_local")
    return names


def task_manager(include: list[str | Path] | None = None, names: list[str] | None = None):
    """lm_eval's TaskManager over fedslice's local tasks, the ``include`` folders and, unless
    every one of ``names`` is among those, lm_eval's own tasks (indexing its ~15,000 YAMLs takes
    a while: skipped when only local tasks are asked for)."""
    from fedslice.harness_tasks import TASKS_DIR
    dirs = [str(TASKS_DIR)]
    for d in include or []:
        p = Path(d).expanduser()
        if not p.is_dir():
            raise ConfigError(f"--harness-include {d}: no such folder (a folder of lm_eval task "
                              "YAMLs)")
        dirs.append(str(p.resolve()))
    if names is not None:
        local = _manager(tuple(dirs), False)
        if set(names) <= set(local.all_tasks):
            return local
    return _manager(tuple(dirs), True)


@functools.lru_cache(maxsize=4)
def _manager(dirs: tuple[str, ...], defaults: bool):
    _, TaskManager = _lm_eval()
    return TaskManager(include_path=list(dirs), include_defaults=defaults)


def check_tasks(tm, names: list[str], include: list[str | Path] | None = None) -> None:
    """Every name is a task, group or tag the manager knows, and its data loads: else a
    one-line error naming the task (and what is close, or the missing file)."""
    from fedslice.harness_tasks import HarnessDataMissing
    known = set(tm.all_tasks)
    for name in names:
        if name not in known:
            where = "lm_eval's tasks, fedslice's local tasks" + (
                f" or {', '.join(map(str, include))}" if include else "")
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"--harness: task {name!r} does not exist (not in {where}){hint}")
        try:
            tm.load([name])
        except HarnessDataMissing as e:
            raise ConfigError(f"--harness: task {name!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the hub unreachable, a broken YAML, ...
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            hub = isinstance(e, (ConnectionError, OSError)) or "hub" in why.lower()
            hint = ("; a hub task's data come from the hub: offline, use the local tasks "
                    "(docs/harness.md)" if hub else "")
            raise FedsliceError(f"--harness: task {name!r} could not be loaded ({type(e).__name__}:"
                                f" {why}){hint}") from None


def harness_model(run: TrainedRun, *, untrained: bool = False):
    """The model and tokenizer to hand to lm_eval's HFLM, and what it is: the trained model
    (adapter merged over a plain base, applied over a quantized one) or, ``untrained``, the base
    as the run loaded it."""
    if untrained:
        run = dataclasses.replace(run, state={})
    rebuilt = trained_model(run)
    model = rebuilt.model
    quantized = run.cfg.model.quantize != "none"
    what = "untrained" if untrained else "trained"
    if rebuilt.adapter is not None and not quantized:
        model = model.merge_and_unload()  # what `fedslice export --format merged` saves
        what += ", adapter merged"
    elif rebuilt.adapter is not None:
        what += f", adapter over the {run.cfg.model.quantize} base"
    elif quantized:
        what += f", {run.cfg.model.quantize} base"
    model.eval()
    return model, rebuilt.loaded.tokenizer, what


def read_harness(path: Path) -> dict[str, Any]:
    """The tasks of a run's ``harness.json`` ({} when there is none); a damaged one is an error
    naming it (read before evaluating: nothing computed is lost to it)."""
    if not path.is_file():
        return {}
    try:
        tasks = json.loads(path.read_text(encoding="utf-8"))["tasks"]
        if not isinstance(tasks, dict):
            raise TypeError("tasks is not an object")
        return tasks
    except (ValueError, KeyError, TypeError) as e:
        raise FedsliceError(f"{path} is damaged ({e}): move it away (the scores it held are "
                            "lost) and evaluate again") from None


def _check_lm(run: TrainedRun) -> None:
    head = run.info.get("head")
    if head not in _LM_HEADS:
        raise ConfigError(f"--harness scores language models: {run.path} trained a {head!r} "
                          f"model (task.kind {run.cfg.task.kind!r}); lm-evaluation-harness needs "
                          "a generation run (a causal or seq2seq LM)")


def _scores(results: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """lm_eval's ``results`` as {task: {"metrics": {metric: value}, "stderr": {...}, ...}},
    for each asked task and every subtask of an asked group."""
    out = {}
    samples = results.get("n-samples", {})
    configs = results.get("configs", {})
    for task, res in results["results"].items():
        metrics, stderr = {}, {}
        for key, v in res.items():
            if key == "alias" or "," not in key or not isinstance(v, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            label = metric if filt == "none" else f"{metric} ({filt})"
            if metric.endswith("_stderr"):
                stderr[label.replace("_stderr", "")] = v if math.isfinite(v) else None
            else:
                metrics[label] = v
        n = samples.get(task, {})
        out[task] = {"metrics": metrics, "stderr": stderr,
                     "samples": n.get("effective"), "of": n.get("original"),
                     "num_fewshot": configs.get(task, {}).get("num_fewshot"),
                     "asked": task in names, "version": results.get("versions", {}).get(task)}
    return out


class _Expected(logging.Filter):
    """Drops lm_eval's warnings about what fedslice does on purpose: an in-memory model, tasks
    that load their data through a function (the local tasks)."""

    NOTES = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model",
             "Custom kwargs can be passed to `--metadata`")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.NOTES)


def run_harness(model, tokenizer, names: list[str], tm, *, limit: float | None = None,
                num_fewshot: int | None = None, batch_size: int | None = None,
                log_samples: bool = False) -> dict[str, Any]:
    """lm_eval's ``simple_evaluate`` on an in-memory model, with the CLI's defaults (seeds,
    bootstrap) so the numbers are the ones ``lm_eval`` prints for the same model.
    ``log_samples``: keep each example's scores (``results["samples"]``, read them with
    :func:`per_example`), e.g. to compare two models question by question."""
    evaluator, _ = _lm_eval()
    from lm_eval.models.huggingface import HFLM
    loggers = [logging.getLogger(n) for n in ("lm_eval.models.huggingface", "lm_eval.api.task")]
    quiet = _Expected()
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size or 1)
        return evaluator.simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot,
                                         limit=limit, task_manager=tm,
                                         log_samples=log_samples)
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)


def per_example(results: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Each example's score from a ``run_harness(..., log_samples=True)`` result, as
    ``{task: {metric: [value of example 0, 1, ...]}}`` in the task's document order (the same
    documents for every model at the same limit, so two models' lists pair up: a paired
    difference's standard error is far below either score's). Metrics whose per-example value is
    not a number (e.g. a perplexity's (loglikelihood, length) pair) are left out."""
    if "samples" not in results:
        raise ValueError("per_example needs the examples: run_harness(..., log_samples=True)")
    out = {}
    for task, rows in results["samples"].items():
        rows = sorted(rows, key=lambda r: r["doc_id"])
        names = rows[0]["metrics"] if rows else []
        out[task] = {m: [float(r[m]) for r in rows] for m in names
                     if all(isinstance(r[m], (int, float)) for r in rows)}
    return out


def evaluate_harness(run_dir: str | Path, tasks: str | list[str], *,
                     include: list[str | Path] | None = None, limit: float | None = None,
                     num_fewshot: int | None = None, baseline: bool = False,
                     batch_size: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Score the run's trained model (and, ``baseline``, the untrained one) on lm_eval tasks;
    write ``harness.json`` (merged with earlier tasks) and refresh ``report.html``. Returns the
    file and this evaluation's entries ``{task: {...}}``."""
    names = parse_tasks(tasks)
    if limit is not None and not (limit > 0):
        raise ConfigError(f"--limit {limit:g}: give a number of examples per task (or a "
                          "fraction below 1)")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {num_fewshot}: give 0 or more")
    run = read_run(run_dir)
    _check_lm(run)
    tm = task_manager(include, names)
    check_tasks(tm, names, include)
    path = run.path / HARNESS
    merged = read_harness(path)
    import lm_eval
    model, tok, what = harness_model(run)
    trained = _scores(run_harness(model, tok, names, tm, limit=limit, num_fewshot=num_fewshot,
                                  batch_size=batch_size), names)
    del model
    base = None
    if baseline:
        model, tok, _ = harness_model(run, untrained=True)
        base = _scores(run_harness(model, tok, names, tm, limit=limit, num_fewshot=num_fewshot,
                                   batch_size=batch_size), names)
        del model
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    entries = {}
    for task, t in trained.items():
        entry = {**t, "limit": limit, "lm_eval": lm_eval.__version__, "evaluated": when,
                 "model": what,
                 "baseline": None}
        if base is not None and task in base:
            entry["baseline"] = {k: base[task][k] for k in ("metrics", "stderr", "samples")}
        entries[task] = entry
    for task, entry in entries.items():
        prev = merged.get(task)
        same = prev and all(prev.get(k) == entry[k] for k in ("limit", "num_fewshot", "samples"))
        if entry["baseline"] is None and same and prev.get("baseline"):
            entry["baseline"] = prev["baseline"]  # still the same comparison
        merged[task] = entry
    write_json_atomic(path, {"tasks": merged})
    try:
        from fedslice.html_report import write_run_report
        write_run_report(run.path)
    except Exception as e:  # noqa: BLE001 - the scores are written; the page is a view of them
        log.warning("report.html not refreshed: %s", e)
    return path, entries


def summary_lines(entries: dict[str, Any]) -> list[str]:
    """One line per task and metric: ``task: metric 0.1234 (base 0.1000, +0.0234) (n of N, k-shot)``."""
    lines = []
    for task, e in entries.items():
        n = f"{e['samples']} of {e['of']} examples" if e.get("of") else f"{e.get('samples')} examples"
        shots = e.get("num_fewshot")
        tail = f" ({n}, {shots}-shot)" if shots is not None else f" ({n})"
        base = (e.get("baseline") or {}).get("metrics", {})
        for metric, v in e["metrics"].items():
            b = base.get(metric)
            cmp = f" (base {b:.4f}, {v - b:+.4f})" if isinstance(b, (int, float)) else ""
            lines.append(f"{task}: {metric} {v:.4f}{cmp}{tail}")
    return lines


__all__ = ["HARNESS", "check_tasks", "evaluate_harness", "harness_model", "parse_tasks",
           "per_example", "run_harness", "summary_lines", "task_manager"]

"""Running experiments: one run into a run folder, or several on the same partition and seed."""

from __future__ import annotations

import logging
import re
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from fedslice.checkpoint import (CHECKPOINT, Checkpoint, check_same_architecture,
                                 check_same_config, config_diff, find_resumable, read_checkpoint,
                                 write_checkpoint)
from fedslice.config import ExperimentConfig, apply_overrides
from fedslice.experiment import load_config, validate_config
from fedslice.errors import ConfigError, FedsliceError
from fedslice import measure
from fedslice.fl.engine import FederatedData, Simulation, prepare_data
from fedslice.methods import Method, Role, build_method, method_class
from fedslice.models.arch import arch_for
from fedslice.models.loading import load_config as load_model_config
from fedslice.models.loading import build_from_config, load_model
from fedslice.output import LATEST_WEIGHTS, RunDir, reserve_folder, write_json_atomic
from fedslice.progress import activate, make_display
from fedslice.html_report import REPORT, write_compare_report, write_run_report
from fedslice.report import markdown_table, plot_compare, plot_run, render_table, summary_row
from fedslice.tasks import make_task
from fedslice.trackers import Trackers

log = logging.getLogger(__name__)

#: partition.json keeps the per-client label histograms up to this many numbers
HISTOGRAM_CELLS = 100_000


def folder_name(cfg: ExperimentConfig) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.run_name).strip(".-") or "run"


def setup(cfg: ExperimentConfig, role: Role = "both") -> tuple[Method, FederatedData]:
    """Build the method (model, strategy) and the federated data of an experiment
    (``role="client"``: as a Flower ClientApp needs it, without the server-only work; for a
    method whose clients get their model from the server (fedpft, fedot), from the model's
    config and tokenizer only: no weight file is read)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.compute.release_memory:
        measure.release_freed_memory(measure.RELEASE_THRESHOLD)
    arch = arch_for(load_model_config(cfg.model)[0])  # the model's config only: no weights yet
    task = make_task(cfg, arch)
    kind = method_class(cfg.method.name)
    kind.check_supported(arch, task)
    raw = task.load_raw()
    if role == "client" and kind.client_model_from_server:
        loaded = build_from_config(cfg.model, task.num_labels(raw), head=task.head)
    else:
        loaded = load_model(cfg.model, task.num_labels(raw), cfg.seed, head=task.head)
    data = prepare_data(cfg, task, task.encode(raw, loaded))
    sizes = {c: len(p) for c, p in enumerate(data.partitions)}
    return build_method(cfg, loaded, task, role, client_sizes=sizes), data


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path | None = None, *,
                   progress: bool | None = None, setup_result=None, verbose: bool = False) -> Path:
    """Run one experiment into a new run folder and return its path.

    The folder appears only when the run has finished (written in a staging folder first).
    ``progress`` (default ``output.progress``): bars on a terminal, else one line per round on
    stdout (``verbose``: with bytes and each client's loss). A run that fails or is interrupted
    after its first round keeps its staging folder (metrics, the latest weights and, with
    ``output.checkpoint_every``, the last checkpoint, for :func:`resume_experiment`) and says
    the command that resumes it; a run that never trained leaves nothing.
    """
    out = Path(out_dir or cfg.output.dir)
    with _display(cfg, progress, verbose):
        method, data = setup_result or setup(cfg)
        run = RunDir.create(out, folder_name(cfg))
        try:
            start_run_folder(run, cfg, method, data)
        except BaseException:
            run.abort()
            raise
        return _run_into(run, cfg, method, data)


def start_run_folder(run: RunDir, cfg: ExperimentConfig, method: Method, data: FederatedData) -> None:
    """What a run folder holds from its start (engine and Flower alike): the resolved config,
    the partition, the label names and what rebuilding the trained model needs."""
    from fedslice.export import INFERENCE, inference_info
    run.write_config(cfg.model_dump(mode="json"))
    report = data.report
    if isinstance(report, dict):  # label histograms for the HTML report, unless huge
        hist = report.get("label_histograms") or []
        small = sum(len(h) for h in hist) <= HISTOGRAM_CELLS
        report = {k: v for k, v in report.items() if k != "label_histograms" or small}
    run.write_json("partition.json", report)
    if data.label_map():
        run.write_json("labels.json", data.label_map())
    run.write_json(INFERENCE, inference_info(cfg, method, method.task))


def _display(cfg: ExperimentConfig, progress: bool | None, verbose: bool):
    show = cfg.output.progress if progress is None else progress
    return activate(make_display(cfg.federation.rounds, cfg.run_name, enabled=show, verbose=verbose))


def resume_experiment(run_dir: str | Path, config: str | Path | None = None,
                      overrides: list[str] | None = None, *, progress: bool | None = None,
                      verbose: bool = False) -> Path:
    """Continue an interrupted run from its checkpoint; return the finished run folder.

    ``run_dir`` is the staging folder (``.NAME.partial-PID``) or the run's final path. The config
    is the checkpoint's (with ``overrides``), or the file ``config``; any difference from the
    checkpoint's config outside ``output`` is refused, naming the fields.
    """
    staging = find_resumable(Path(run_dir))
    ckpt = read_checkpoint(staging)
    if config is None:
        cfg = validate_config(apply_overrides(ckpt.config, overrides or []), f"(checkpoint of {staging})")
    else:
        cfg = load_config(config, overrides)
    given = cfg.model_dump(mode="json")
    if not any(d.startswith("model.") for d in config_diff(ckpt.config, given)):
        check_same_config(ckpt.config, given, staging)  # before loading anything
    with _display(cfg, progress, verbose):
        method, data = setup(cfg)
        # another model: name both architectures (also when the config names the same path but
        # the files there changed); then any other field that differs
        check_same_architecture(ckpt, method, staging)
        check_same_config(ckpt.config, given, staging)
        run = RunDir.reopen(staging)
        run.rewrite_metrics(ckpt.records)
        log.warning("resuming %s after round %d of %d", staging, ckpt.round, cfg.federation.rounds)
        return _run_into(run, cfg, method, data, resume=ckpt)


def _run_into(run: RunDir, cfg: ExperimentConfig, method: Method, data: FederatedData,
              resume: Checkpoint | None = None) -> Path:
    sim = Simulation(cfg, method, data)

    def checkpoint(ckpt: Checkpoint) -> None:
        write_checkpoint(run.path, ckpt)

    trackers = Trackers(cfg, run.staging_path, folder_name(cfg))

    def on_round(record: dict[str, Any]) -> None:
        run.append_metrics(record)
        trackers.round(record)

    try:
        with run:  # kept on a failure after a round (RunDir.trained), else removed
            try:
                state, _, summary = sim.run(on_round=on_round, resume=resume,
                                            on_checkpoint=checkpoint)
                save_results(run, cfg, method, state, summary)
                trackers.finish(summary)  # before the folder is renamed
            except BaseException as e:
                if run.trained:
                    keep_failed_run(run, method, sim.latest, e,
                                    f"fedslice run --resume {shlex.quote(str(run.staging_path))}")
                raise
    finally:
        trackers.finish(None)  # the run failed (no-op when finished)
    path = run.final_path
    if cfg.output.plots:
        plot_run(path)
        write_run_report(path)
    return path


def keep_failed_run(run: RunDir, method: Method, latest: tuple[int, dict] | None,
                    error: BaseException, resume_command: str) -> str:
    """After a failure (exception, Ctrl-C, SIGTERM) of a run that finished a round, before its
    staging folder is left in place: write the latest global weights there, then say (log warning, and a note on
    ``error``) what is there and the exact command that resumes it. Returns that message."""
    what = ["metrics.jsonl"]
    if latest is not None:
        rnd, state = latest
        try:
            run.save_weights(method.export_state(state), LATEST_WEIGHTS, {"round": str(rnd)})
            what.append(f"{LATEST_WEIGHTS} (the weights after round {rnd})")
        except Exception as e:  # noqa: BLE001 - keep what is there; say why the weights are not
            log.error("could not save the latest weights into %s: %s", run.staging_path, e)
    ckpt = run.staging_path / CHECKPOINT
    if ckpt.is_file():
        what.append(CHECKPOINT)
        how = f"continue it with: {resume_command}"
    else:
        how = ("it has no checkpoint (output.checkpoint_every = 0), so it cannot be resumed; "
               "set output.checkpoint_every = 1 to make runs resumable")
    kind = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    message = f"the run {kind}; what it finished is kept in {run.staging_path} ({', '.join(what)}); {how}"
    log.warning("%s", message)
    error.add_note(message)
    return message


def save_results(run: RunDir, cfg: ExperimentConfig, method, state, summary: dict[str, Any]) -> None:
    """Summary, method artifacts and final weights into a run folder (engine and Flower alike);
    the checkpoint and the latest weights of an earlier failure go (the run is complete)."""
    run.write_summary(summary)
    method.write_artifacts(run.path)
    if cfg.output.save_weights:
        run.save_weights(method.export_state(state))
    for name in (CHECKPOINT, LATEST_WEIGHTS):
        (run.path / name).unlink(missing_ok=True)


def _same_setting(cfgs: list[ExperimentConfig]) -> list[ExperimentConfig]:
    """Every compared run uses the first config's data, partition, seed and client counts."""
    base = cfgs[0]
    out = [base]
    for cfg in cfgs[1:]:
        if cfg.data != base.data or cfg.seed != base.seed or \
                cfg.federation.num_clients != base.federation.num_clients:
            log.warning("compare: %s uses the data/seed/num_clients of %s", cfg.run_name, base.run_name)
        fed = cfg.federation.model_copy(update={"num_clients": base.federation.num_clients})
        out.append(cfg.model_copy(update={"data": base.data, "seed": base.seed, "federation": fed}))
    return out


def compare_experiments(cfgs: list[ExperimentConfig], out_dir: str | Path | None = None, *,
                        progress: bool | None = None, name: str | None = None,
                        verbose: bool = False) -> tuple[Path, str]:
    """Run several experiments on the same partition and seed into one folder; return its path
    and the results table.

    Each run lands in its own final folder inside it as soon as it ends, and ``results.md`` /
    ``results.json`` are rewritten after each: a failure of a later run leaves the earlier ones
    intact, and is raised with a note naming the failed run (a :class:`FedsliceError` of the
    run becomes one naming it). The folder is removed only if nothing at all was kept in it."""
    if not cfgs:
        raise ConfigError("compare needs at least one config")
    names = [folder_name(c) for c in cfgs]
    if len(set(names)) != len(names):
        raise ConfigError(f"compare: run names must differ (set `name` in each config): {names}")
    cfgs = _same_setting(cfgs)
    out = Path(out_dir or cfgs[0].output.dir)
    folder = reserve_folder(out, name or f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    runs: list[Path] = []
    rows: list[dict[str, Any]] = []
    for i, cfg in enumerate(cfgs):
        try:
            runs.append(run_experiment(cfg, folder, progress=progress, verbose=verbose))
        except BaseException as e:
            failure = _compare_failed(folder, names, i, runs, e)
            if failure is e:
                raise
            raise failure from e
        rows.append(summary_row(_read_summary(runs[-1])))
        (folder / "results.md").write_text(markdown_table(rows) + "\n")
        write_json_atomic(folder / "results.json", rows)
    table = render_table(rows, f"fedslice compare ({len(runs)} runs)")
    plot_compare(runs, folder / "compare.png")
    write_compare_report(runs, folder / REPORT, f"fedslice compare: {folder.name}")
    return folder, table


def _compare_failed(folder: Path, names: list[str], i: int, runs: list[Path],
                    error: BaseException) -> BaseException:
    """The exception a compare raises when its ``i``-th run fails: ``error`` with a note (a
    FedsliceError: a new one whose message names the run), after the log says what is kept."""
    kind = "was interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    done = ", ".join(r.name for r in runs) or "none"
    message = (f"compare: run {names[i]!r} ({i + 1} of {len(names)}) {kind}; finished runs in "
               f"{folder}: {done}" + (f"; not run: {', '.join(names[i + 1:])}" if i + 1 < len(names) else ""))
    log.error("%s", message)
    if not any(folder.iterdir()):
        folder.rmdir()  # nothing finished, nothing kept
    if isinstance(error, FedsliceError):
        return FedsliceError(f"{message}: {error}")
    error.add_note(message)
    return error


def _read_summary(run: Path) -> dict[str, Any]:
    import json
    return json.loads((run / "summary.json").read_text())

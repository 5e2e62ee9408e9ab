"""The one run lifecycle, for the in-process engine, ``--resume`` and Flower's ServerApp alike.

=========  ==========================================================================
create     a new staging folder with what a run folder holds from its start
reopen     an interrupted run's staging folder, from its checkpoint (``--resume``)
round      each finished round: metrics.jsonl, trackers, the latest state, a checkpoint
           every ``output.checkpoint_every`` rounds
finish     summary, method artifacts, final weights; the folder renamed to its final name;
           plots and the HTML report
fail       after a finished round: the latest weights kept in the staging folder, and the
           exact command that resumes the run; before any round: nothing left
=========  ==========================================================================

:class:`Rounds` is the part the round drivers (:class:`fedslice.run.engine.Simulation`, the
ServerApp's evaluation hook) talk to: where the rounds start and what happens to each finished
one. On its own it keeps the rounds in memory (a run without a folder: tests, benchmarks);
:class:`RunSession` adds the run folder.
"""

from __future__ import annotations

import json

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedslice.config import ExperimentConfig
from fedslice.data.federated import FederatedData
from fedslice.fl.strategy import State, host_state
from fedslice.methods import Method
from fedslice.models.arch import CLASSIFIER_HEADS
from fedslice.output import LATEST_WEIGHTS, RunDir
from fedslice.run.checkpoint import CHECKPOINT, Checkpoint, capture, restore, write_checkpoint
from fedslice.trackers import Trackers

log = logging.getLogger(__name__)

#: partition.json keeps the per-client label histograms up to this many numbers
HISTOGRAM_CELLS = 100_000
#: what rebuilding the trained model for inference needs (beside config.json and the weights)
INFERENCE = "inference.json"


def folder_name(cfg: ExperimentConfig) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", cfg.run_name).strip(".-") or "run"


class Rounds:
    """The rounds of one run as its driver sees them, kept in memory: the state they start from
    (a resumed run's checkpoint, else the method's initial state), the round they start at, the
    run's clock, every finished round's record and the latest (round, state)."""

    def __init__(self, cfg: ExperimentConfig, method: Method, checkpoint: Checkpoint | None = None):
        self.cfg, self.method, self.checkpoint = cfg, method, checkpoint
        self.records: list[dict[str, Any]] = list(checkpoint.records) if checkpoint else []
        #: rounds finished before this process started (a resumed run)
        self.done = checkpoint.round if checkpoint else 0
        self.t_start = time.perf_counter() - (checkpoint.elapsed_s if checkpoint else 0.0)
        #: (round, global state) after the last finished round: what a failed run keeps
        self.latest: tuple[int, State] | None = None

    def initial_state(self, selector, clock=None) -> State:
        """The global state the first round of this process starts from (``selector`` and the
        simulated ``clock``, when the run has one, get back the checkpoint's)."""
        if self.checkpoint is None:
            return host_state(self.method.initial_state())
        state = restore(self.checkpoint, self.method, selector, clock)
        self.latest = (self.checkpoint.round, state)
        return state

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def round_done(self, server_round: int, state: State, record: dict[str, Any], selector,
                   clock=None) -> None:
        """A finished (aggregated and evaluated) round; ``clock``: the simulated clock (and
        what an asynchronous run has in flight), kept in checkpoints."""
        record["elapsed_s"] = self.elapsed()
        self.records.append(record)
        self.latest = (server_round, state)


class RunSession(Rounds):
    """One run in its run folder: :meth:`create` or :meth:`reopen`, then :meth:`run`."""

    def __init__(self, cfg: ExperimentConfig, method: Method, folder: RunDir, resume_command: str,
                 checkpoint: Checkpoint | None = None,
                 sources: dict[str, dict[str, str]] | None = None):
        super().__init__(cfg, method, checkpoint)
        self.folder = folder
        self.resume_command = resume_command
        #: the data splits read and their content keys, recorded in every checkpoint
        self.sources = sources
        self.trackers = Trackers(cfg, folder.staging_path, folder_name(cfg))

    @classmethod
    def create(cls, cfg: ExperimentConfig, method: Method, data: FederatedData, out_dir: Path,
               resume_command: Callable[[Path], str]) -> RunSession:
        """A new run under ``out_dir`` (its staging folder); ``resume_command(staging)`` is what
        a failure tells the user to run."""
        folder = RunDir.create(out_dir, folder_name(cfg))
        try:
            start_run_folder(folder, cfg, method, data)
            return cls(cfg, method, folder, resume_command(folder.staging_path),
                       sources=data.sources)
        except BaseException:
            folder.abort()
            raise

    @classmethod
    def reopen(cls, cfg: ExperimentConfig, method: Method, staging: Path, checkpoint: Checkpoint,
               resume_command: Callable[[Path], str],
               sources: dict[str, dict[str, str]] | None = None) -> RunSession:
        """An interrupted run, continued from ``checkpoint`` (metrics after it are dropped);
        ``cfg``'s ``output.name`` names the final folder (it may change on resume)."""
        folder = RunDir.reopen(staging, folder_name(cfg))
        folder.write_config(cfg.model_dump(mode="json"))
        folder.rewrite_metrics(checkpoint.records)
        log.warning("resuming %s after round %d of %d", staging, checkpoint.round,
                    cfg.federation.rounds)
        return cls(cfg, method, folder, resume_command(staging), checkpoint, sources)

    def round_done(self, server_round: int, state: State, record: dict[str, Any], selector,
                   clock=None) -> None:
        super().round_done(server_round, state, record, selector, clock)
        self.folder.append_metrics(record)
        self.trackers.round(record)
        every = self.cfg.output.checkpoint_every
        if every and server_round % every == 0:
            ckpt = capture(server_round, self.cfg.model_dump(mode="json"), self.method,
                           selector, state, self.records, self.elapsed(), clock)
            ckpt.data = self.sources  # what a resume checks its data against
            write_checkpoint(self.folder.path, ckpt)

    def run(self, train: Callable[[], tuple[State, dict[str, Any]]]) -> Path:
        """Run ``train`` (the rounds; it returns the final state and the summary) in the run
        folder: finished, it is saved under its final name (with plots and the report when
        ``output.plots``); failed after a round, it is kept with the command that resumes it.
        Returns the final folder."""
        try:
            with self.folder:  # kept on a failure after a round (RunDir.trained), else removed
                try:
                    state, summary = train()
                    save_results(self.folder, self.cfg, self.method, state, summary)
                    self.trackers.finish(summary)  # before the folder is renamed
                except BaseException as e:
                    if self.folder.trained:
                        keep_failed_run(self.folder, self.method, self.latest, e, self.resume_command)
                    raise
        finally:
            self.trackers.finish(None)  # the run failed (no-op when finished)
        path = self.folder.final_path
        if self.cfg.output.plots:
            from fedslice.html_report import write_run_report
            from fedslice.report import plot_run
            plot_run(path)
            write_run_report(path)
        return path


def inference_info(cfg: ExperimentConfig, method: Method, task) -> dict[str, Any]:
    """What rebuilding the trained model for inference needs beyond the config and the weights."""
    config = method.model.config
    return {"format": 1, "model_type": method.arch.model_type, "head": task.head,
            "num_labels": config.num_labels if task.head in CLASSIFIER_HEADS else None,
            "label_names": task.label_names, "text_columns": task.text_columns,
            "task": task.kind, "exclude": list(method.deploy_exclude)}


def start_run_folder(run: RunDir, cfg: ExperimentConfig, method: Method, data: FederatedData) -> None:
    """What a run folder holds from its start: the resolved config, the partition, the label
    names and what rebuilding the trained model needs."""
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


def keep_failed_run(run: RunDir, method: Method, latest: tuple[int, dict] | None,
                    error: BaseException, resume_command: str) -> str:
    """After a failure (exception, Ctrl-C, SIGTERM) of a run that finished a round, before its
    staging folder is left in place: write the latest global weights there, then say (log
    warning, and a note on ``error``) what is there and the exact command that resumes it.
    Returns that message."""
    what = ["metrics.jsonl"]
    if latest is not None:
        rnd, state = latest
        try:
            run.save_weights(method.exported(state), LATEST_WEIGHTS, {"round": str(rnd)})
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


def save_results(run: RunDir, cfg: ExperimentConfig, method: Method, state: State,
                 summary: dict[str, Any]) -> None:
    """Summary, method artifacts and final weights into a run folder; the checkpoint and the
    latest weights of an earlier failure go (the run is complete)."""
    run.write_summary(summary)
    method.write_artifacts(run.path)
    if method.plans:  # [budgets]: every client's plan, as `fedslice plan --json` writes it
        (run.path / "plans.json").write_text(json.dumps(
            {str(c): p.to_dict() for c, p in sorted(method.plans.items())}, indent=1))
    if cfg.output.save_weights:
        run.save_weights(method.exported(state))
    for name in (CHECKPOINT, LATEST_WEIGHTS):
        (run.path / name).unlink(missing_ok=True)
